"""Bad model file: module-level code raises."""

raise RuntimeError("weights not found at /nowhere")
