"""lm-eval run as a user would: its ``local-completions`` model against ``tierserve up`` on a local
multiple-choice task (benchmarks/lm_eval_task: YAML + JSON lines, nothing downloaded) gives the same
accuracy and per-choice log-likelihoods as its ``hf`` model on the same weights through transformers."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import free_port, running_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK_DIR = Path(__file__).parents[1] / "benchmarks" / "lm_eval_task"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TOL = 1e-4  # a choice's log-likelihood sums a few tokens' logprobs


def lm_eval(model: str, model_args: str, out: Path, *extra: str) -> dict:
    """Runs the ``lm_eval`` CLI in the task's folder; returns (accuracy, per-doc responses)."""
    cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", model, "--model_args", model_args,
           "--tasks", "tierserve_mc", "--include_path", ".", "--output_path", str(out), "--log_samples", *extra]
    run = subprocess.run(cmd, cwd=TASK_DIR, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(Path(glob.glob(f"{out}/*/results_*.json")[0]).read_text())["results"]["tierserve_mc"]
    samples = [json.loads(line) for line in Path(glob.glob(f"{out}/*/samples_*.jsonl")[0]).read_text().splitlines()]
    return {"acc": results["acc,none"], "docs": {s["doc_id"]: [(float(r[0][0]), r[0][1]) for r in s["resps"]]
                                                 for s in samples}}


def test_local_completions_on_up_equals_hf(builtin_model: Path, tmp_path: Path) -> None:
    reference = lm_eval("hf", f"pretrained={builtin_model},dtype=float32", tmp_path / "hf", "--device", "cpu",
                        "--batch_size", "8")
    port = free_port()
    with running_up(port, "--model", str(builtin_model), "--dtype", "float32", "--max-total-tokens", "8192",
                    "--no-l3"):
        args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model={builtin_model.name},"
                f"tokenizer={builtin_model},tokenizer_backend=huggingface,tokenized_requests=True")
        ours = lm_eval("local-completions", args, tmp_path / "ours")
    assert ours["acc"] == reference["acc"] and 0.5 <= ours["acc"] < 1  # the task separates right from wrong
    assert ours["docs"].keys() == reference["docs"].keys() and len(ours["docs"]) == 20
    for doc, choices in reference["docs"].items():
        assert [greedy for _, greedy in ours["docs"][doc]] == [greedy for _, greedy in choices]
        assert max(abs(a - b) for (a, _), (b, _) in zip(ours["docs"][doc], choices, strict=True)) < TOL, doc
