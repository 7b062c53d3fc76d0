"""`bertforge demo`: the whole chain on a built-in corpus, through the real engines, in minutes.

    corpus (docstrings) -> WordPiece vocab -> Beam prepare (DirectRunner, 2 processes) ->
    Ray Train + DeepSpeed ZeRO-2 (2 CPU workers; bf16 where the CPU has it natively, else
    fp32) -> evaluation -> Hugging Face export -> SST-2 fine-tuned from it and from random
    init, beside a bag-of-words baseline -> summary

Everything of the demo is here:
- `config`: `DemoConfig`, whose fields are the `bertforge demo` flags;
- `run`: the stages on the stage runner (`cluster.commands.stage_runner`); vocab, prepare, train and
  export are `bertforge pipeline`'s own stage bodies (`cluster.commands.stages`);
- `docstring_corpus`: the corpus, gathered at run time from the docstrings on this machine;
- `sst2` and `bow_baseline`: the last stage, SST-2 three ways on one budget, from the subset
  shipped in `data/sst2/` (package data) unless --glue-dir gives GLUE's;
- `summary`: the printed summary, summary.json and the loss curve.
"""

from bertforge.cluster.demo.config import DemoConfig
from bertforge.cluster.demo.run import run_demo

__all__ = ["DemoConfig", "run_demo"]
