"""Bad model file: a syntax error."""

def build_model(:
    return None
