"""Runs llama.cpp's convert_hf_to_gguf.py (from the source tree given) on a model folder.

The benchmark model's tokenizer is a byte-level BPE with GPT-2's pre-tokenizer regex but a
vocabulary of its own (benchmarks/common.py: build_bench_tokenizer). The converter recognises
pre-tokenizers by hashing the ids of a test string, which no vocabulary of its own can match,
so an unrecognised one is labelled "gpt-2" here (its actual pre-tokenizer) instead of failing.

    python tools/convert_to_gguf.py LLAMA_CPP_DIR -- HF_DIR --outtype f16 --outfile OUT.gguf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit(__doc__)
    llama = Path(sys.argv[1]).resolve()
    argv = sys.argv[3:]
    sys.path[:0] = [str(llama), str(llama / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:  # noqa: ANN001
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            pre = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())["pre_tokenizer"]
            if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
                raise
            print("pre-tokenizer: byte-level with GPT-2's regex -> 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
