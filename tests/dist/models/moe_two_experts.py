"""The zoo's plain-torch stacked-experts decoder (examples/zoo/torch_moe_stacked.py) with two
experts, top-1 (weighted by the router probability): at ep 2 a rank holds one expert, whose stacked parameters' first dimension (1)
cannot be split over its edp ranks -- FSDP2 shards another dimension there
(executor/parallel/expert_parallel.py ``_even_shard``)."""

from pathlib import Path

_ZOO = Path(__file__).resolve().parents[3] / "examples" / "zoo" / "torch_moe_stacked.py"
# top-1 weighted by the router's probability itself: renormalised over one expert it would be 1,
# and the router would get no gradient (Adam then steps on rounding noise)
_SOURCE = (_ZOO.read_text(encoding="utf-8").replace("experts=4, top_k=2", "experts=2, top_k=1", 1)
           .replace("scores / scores.sum(-1, keepdim=True)", "scores", 1))
exec(compile(_SOURCE, str(_ZOO), "exec"))  # noqa: S102 - the zoo file's definitions, two experts
