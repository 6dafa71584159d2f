"""``tierserve serve --tp-size N`` as real processes, for the tensor-parallel tests: the reference
models and answers, start, wait for health against a deadline, list the node's processes, stop."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import torch
from tokenizers import Tokenizer

from helpers.forked import ForkedProcess, Started, start_cli
from helpers.polling import wait_until
from helpers.processes import alive, cmdline, stop
from tierserve.launch import free_port, http_ok

STARTUP_DEADLINE_S = 120.0
# (attention heads, KV heads): 4 and 8 KV heads split evenly; Qwen3's 2 are fewer than 4 ranks (replicated).
HEADS = {"llama": (8, 4), "qwen2": (8, 8), "qwen3": (8, 2)}
PROMPT_LENGTHS = (5, 17, 40, 70)  # the server's prefill chunk is 16 tokens
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    """Four random prompts, the longest over four prefill chunks."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 384, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """``NEW_TOKENS`` greedy tokens per prompt from ``transformers`` (the reference), EOS ignored."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@dataclass
class TPServer:
    """One node of ``tp_size`` ranks; ``proc`` is rank 0 (HTTP), the other ranks are its children."""

    proc: ForkedProcess
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def healthy(self) -> bool:
        return http_ok(f"{self.url}/health")

    def wait_healthy(self) -> TPServer:
        wait_until(self.healthy, "tierserve serve", STARTUP_DEADLINE_S, self.proc, self.log)
        return self

    def stop(self) -> None:
        stop(self.proc)


def start_server(model: Path, tp_size: int, log: Path, *flags: str, env: dict[str, str] | None = None) -> TPServer:
    """Starts ``serve`` (not waiting for it): float32, small pages and 16-token prefill chunks, so
    prompts of a few dozen tokens take several chunks; ``env`` adds to the test's environment
    (``helpers.injected_faults.node_env``)."""
    port = free_port()
    argv = ["serve", "--model", str(model), "--port", str(port), "--tp-size", str(tp_size), "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", "2048", "--chunked-prefill-size", "16", "--quiet-access-log",
            *flags]
    proc = start_cli(argv, log, env, append=False)
    return TPServer(proc, port, log)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_gone(pids: set[int], deadline_s: float) -> list[str]:
    """Waits until none of ``pids`` runs; returns the command lines of those still running at the deadline."""
    deadline = time.monotonic() + deadline_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval
    return [_cmdline(pid) for pid in left]


def _cmdline(pid: int) -> str:
    line = cmdline(pid)
    return f"{pid}: " + (line.replace(b"\0", b" ").decode() if line else "gone")


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    """The text of a greedy completion of ``NEW_TOKENS`` (EOS ignored)."""
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].text


def rank_pids(parent: int, expected: int) -> list[int]:
    """A node's rank processes after rank 0 (its children that are not multiprocessing's resource
    tracker), sorted; asserts there are ``expected`` of them."""
    pids = sorted(pid for pid in descendants(parent) if b"resource_tracker" not in cmdline(pid))
    assert len(pids) == expected, pids
    return pids


def wait_exit(proc: Started, deadline_s: float) -> int:
    """``proc``'s exit status; kills it and fails if it still runs after ``deadline_s``."""
    try:
        return proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{proc.args[:4]} still running {deadline_s} s after a rank died") from None


def complete_all(server: TPServer, model: Path, asked: list[list[int]]) -> list[str]:
    """Every prompt's greedy answer text, all sent at once (concurrent: they share steps)."""
    client = server.client()
    with ThreadPoolExecutor(len(asked)) as pool:
        return list(pool.map(lambda p: complete(client, model.name, p), asked))


def token_ids(model: Path, texts: list[str]) -> list[list[int]]:
    """Answer texts as token ids, through the model's word tokenizer."""
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    return [words.encode(text).ids for text in texts]
