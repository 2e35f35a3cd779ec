"""Generation kept in flight on an offline ``vllm.LLM`` whose engine core runs in this process, stepped by hand:
what a staged refit's engine serves while a round arrives (``sink=vllm sink.staged=true``, the staged benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class Traffic:
    """Requests of ``prompts`` (token ids), ``max_tokens`` greedy tokens each, kept in flight on ``llm``'s engine:
    :meth:`step` tops them up to one of each prompt and steps the engine once. Counts the tokens generated
    (:attr:`tokens`) and keeps each finished request's output (with vLLM's ``weight_versions``)."""

    def __init__(self, llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, *, prefix: str = "r") -> None:
        from vllm import SamplingParams

        if not prompts or max_tokens < 1:
            raise ValueError("Traffic needs at least one prompt and max_tokens >= 1")
        self.engine = llm.llm_engine
        self.prompts = [list(p) for p in prompts]
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        self.seen: dict[str, int] = {}
        """Tokens generated so far per request id."""
        self.finished: dict[str, Any] = {}
        self.tokens = 0
        self._prefix = prefix
        self._next = 0

    def add(self, prompt: Sequence[int], params: Any = None) -> str:
        """One more request; returns its id."""
        rid = f"{self._prefix}{self._next}"
        self._next += 1
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params or self.params)
        self.seen[rid] = 0
        return rid

    def step(self) -> None:
        if len(self.in_flight()) < len(self.prompts):
            for prompt in self.prompts:
                self.add(prompt)
        self._step()

    def _step(self) -> None:
        for out in self.engine.step():
            n = len(out.outputs[0].token_ids)
            self.tokens += n - self.seen.get(out.request_id, 0)
            self.seen[out.request_id] = n
            if out.finished:
                self.finished[out.request_id] = out

    def in_flight(self) -> list[str]:
        return [r for r in self.seen if r not in self.finished]

    def run(self, rid: str, deadline: float) -> Any:
        """Step until request ``rid`` finishes (by ``deadline``, a ``time.monotonic()`` value); its output."""
        while rid not in self.finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} did not finish")
            self.step()
        return self.finished[rid]

    def drain(self, deadline: float) -> None:
        """Step until nothing is in flight (by ``deadline``), adding nothing."""
        while self.engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("the requests in flight did not finish")
            self._step()
