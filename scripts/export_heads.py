#!/usr/bin/env python
"""Export trained heads for a serving engine: an EAGLE-3 checkpoint that vLLM and SGLang load.

    python scripts/export_heads.py --heads DIR_OR_HUB_ID --format eagle3 --output_dir OUT [--dtype bfloat16]

Then, for example: ``vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config
'{"method": "eagle3", "model": "OUT", "num_speculative_tokens": 4}'`` (README "Serving"). The backbone is loaded to
read its lm_head rows at the draft vocabulary (default: the one the heads name). Bad input ends in one `error:` line
and exit status 2 (--debug: the traceback).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from tokenmaxx.heads import load_backbone, load_heads
from tokenmaxx.heads.io.eagle3_export import export_eagle3
from tokenmaxx.scripts.errors import run_script

FORMATS = {"eagle3": export_eagle3}


@dataclass
class ExportArgs:
    heads: str = field(metadata={"help": "heads folder or Hub id (kind eagle3 for --format eagle3)"})
    output_dir: str = field(metadata={"help": "folder to write (refused if it exists and is not empty, unless "
                                              "--overwrite)"})
    format: str = field(default="eagle3", metadata={"help": f"checkpoint format, one of {sorted(FORMATS)}"})
    backbone: str | None = field(default=None, metadata={
        "help": "backbone alias / folder / Hub id (default: the one the heads were made for)"})
    dtype: str = field(default="bfloat16", metadata={"help": "weights dtype of the export: bfloat16, float16, float32"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder"})

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown --format {self.format!r}: expected one of {sorted(FORMATS)}")


def main(argv=None) -> int:
    (args,) = HfArgumentParser(ExportArgs).parse_args_into_dataclasses(argv)
    heads = load_heads(args.heads)
    backbone = args.backbone or heads.config.backbone
    if not backbone:
        raise ValueError(f"the heads in {args.heads} name no backbone: pass --backbone")
    model, _ = load_backbone(backbone, dtype="float32", device="cpu")
    out = FORMATS[args.format](heads, model, args.output_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {args.format} checkpoint {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
