"""A tensor-parallel engine built at module level, without a main guard, as vLLM users write."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.worker.start_method import inside_main_guard, unguarded_main_script

_UNGUARDED = """
import sys
from pagedllm import LLM, SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", block_size=4,
          kv_cache_memory_bytes=1 << 20)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
print("TOKENS", out.outputs[0].token_ids, out.outputs[0].finish_reason)
llm.llm_engine.shutdown()
"""


def test_tp_script_without_main_guard_generates(tiny_llama, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(_UNGUARDED))
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapping phase" not in proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS"))
    assert line.endswith("length")  # all six tokens generated, no error finish
    assert len(line.split("[")[1].split("]")[0].split(",")) == 6


def test_main_guard_is_recognised(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import os\n"  # 1
        "x = 1\n"  # 2
        "if __name__ == '__main__':\n"  # 3
        "    y = 2\n"  # 4
        "    z = 3\n"  # 5
        "else:\n"  # 6
        "    w = 4\n"  # 7
        "if '__main__' == __name__:\n"  # 8
        "    v = 5\n"  # 9
    )
    assert not inside_main_guard(str(script), 2)
    assert inside_main_guard(str(script), 4) and inside_main_guard(str(script), 5)
    assert not inside_main_guard(str(script), 7)  # the else branch runs in a child
    assert inside_main_guard(str(script), 9)


def test_a_call_from_this_test_is_not_at_script_level():
    # pytest's own main module is not on this call's stack at module level
    assert unguarded_main_script(sys._getframe()) is None


def test_unsafe_fork_fails_at_once_saying_what_to_write(monkeypatch):
    from pagedllm.worker import start_method

    monkeypatch.setattr(start_method, "unguarded_main_script", lambda frame: "/x/run.py")
    monkeypatch.setattr(start_method, "fork_is_safe", lambda: False)
    with pytest.raises(RuntimeError, match='if __name__ == "__main__":') as e:
        start_method.worker_context([])
    assert "/x/run.py" in str(e.value)
    monkeypatch.setattr(start_method, "fork_is_safe", lambda: True)
    assert start_method.worker_context([]).get_start_method() == "fork"
