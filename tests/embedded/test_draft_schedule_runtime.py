"""The draft-length schedule at runtime, live: `autotune serve --draft-schedule FILE` on the bundled model
(float32, eager, n-gram drafter) drafts k = 6 for a lone stream and nothing in a step of several, its greedy
output stays plain decoding's, and POST /admin/runtime swaps the schedule on the running server. What is
checked is counted (tokens proposed per batch size of a step), never timed."""
import asyncio
import json
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from conftest import EmbeddedServer

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.embedded.drafters import NgramDrafter
from autotune.embedded.scheduler import Engine
from autotune.engines.embedded import EmbeddedAdapter
from autotune.engines.launcher import free_port, release_port

ONE_DRAFTS_MANY_DO_NOT = {"drafter": "ngram", "rows": [{"max_batch": 1, "draft_length": 6},
                                                        {"max_batch": 8, "draft_length": 0}]}
# Repetitive prompts: the n-gram drafter finds matches in them whatever the batch.
PROMPTS = [f"{name} = [1, 2, 3]\n{name} = [1, 2, 3]\n{name} = [1, 2," for name in ("alpha", "beta", "gamma")]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = DraftSchedule.model_validate(ONE_DRAFTS_MANY_DO_NOT).dump(tmp_path_factory.mktemp("schedule") / "s.yaml")
    server = EmbeddedServer(drafter="ngram", draft_length=6, verify_slots=4, max_seq_len=256, draft_schedule=path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def by_batch(client: httpx.Client) -> dict[str, dict[int, float]]:
    """The engine's per-batch-size counters on /metrics: {"steps"|"draft_tokens": {batch size: count}}."""
    out = {"steps": {}, "draft_tokens": {}}
    for line in client.get("/metrics").text.splitlines():
        for kind, counts in out.items():
            prefix = f'autotune_spec_batch_{kind}_total{{batch="'
            if line.startswith(prefix):
                batch, value = line[len(prefix):].split('"} ')
                counts[int(batch)] = float(value)
    return out


def since(before: dict, after: dict) -> dict:
    return {kind: {b: n - before[kind].get(b, 0) for b, n in after[kind].items()} for kind in after}


def complete(client: httpx.Client, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0} | extra
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def complete_together(url: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        responses = await asyncio.gather(*(c.post("/v1/completions", json={
            "prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}) for p in prompts))
    return [r.json() for r in responses]


def test_a_lone_stream_drafts_and_a_batch_of_three_proposes_nothing_with_plain_greedy_output(server, client):
    plain = [complete(client, p, draft_length=0)["choices"][0]["text"] for p in PROMPTS]  # k = 0: plain decoding

    before = by_batch(client)
    alone = complete(client, PROMPTS[0])
    counted = since(before, by_batch(client))
    assert alone["usage"]["spec_draft_tokens"] > 0
    assert counted["draft_tokens"] == {1: alone["usage"]["spec_draft_tokens"]}  # all of it in steps of one
    assert alone["choices"][0]["text"] == plain[0]

    before = by_batch(client)
    together = asyncio.run(complete_together(server.url, PROMPTS))
    counted = since(before, by_batch(client))
    assert counted["steps"].get(3, 0) > 0, counted  # the three ran together for some steps...
    assert all(n == 0 for b, n in counted["draft_tokens"].items() if b > 1), counted  # ...and proposed nothing
    # what was proposed, was proposed in steps of one (before the others joined)
    assert sum(r["usage"]["spec_draft_tokens"] for r in together) == counted["draft_tokens"].get(1, 0)
    assert [r["choices"][0]["text"] for r in together] == plain


def test_the_runtime_endpoint_swaps_the_schedule_on_the_running_server(client, tmp_path):
    assert client.get("/admin/runtime").json()["draft_schedule"] == ONE_DRAFTS_MANY_DO_NOT
    lone_off = {"drafter": "ngram", "rows": [{"max_batch": 1, "draft_length": 0}, {"max_batch": 8, "draft_length": 6}]}
    try:
        assert client.post("/admin/runtime", json={"draft_schedule": lone_off}).json()["draft_schedule"] == lone_off
        assert complete(client, PROMPTS[1])["usage"]["spec_draft_tokens"] == 0
        for bad in ({"drafter": "ngram", "rows": []}, {"drafter": "early_exit", "rows": lone_off["rows"]},
                    {"drafter": "ngram", "rows": [{"max_batch": 1, "draft_length": 17}]}, "s.yaml"):
            response = client.post("/admin/runtime", json={"draft_schedule": bad})
            message = response.json()["error"]["message"]
            assert response.status_code == 400 and "draft_schedule" in message and "\n" not in message, message
        assert client.get("/admin/runtime").json()["draft_schedule"] == lone_off  # a refused one changes nothing
        # No schedule: the request's own k alone.
        assert client.post("/admin/runtime", json={"draft_schedule": None}).json()["draft_schedule"] is None
        assert complete(client, PROMPTS[1])["usage"]["spec_draft_tokens"] > 0
        # The tuner's adapter sends a schedule file's contents.
        EmbeddedAdapter().apply_runtime(str(client.base_url), {"draft_schedule": str(
            DraftSchedule.model_validate(lone_off).dump(tmp_path / "lone_off.json"))})
        assert client.get("/admin/runtime").json()["draft_schedule"] == lone_off
    finally:
        client.post("/admin/runtime", json={"draft_schedule": ONE_DRAFTS_MANY_DO_NOT})


@pytest.mark.parametrize("text, phrase", [
    ("drafter: ngram\nrows: [{max_batch: 4, draft_length: 2}, {max_batch: 2, draft_length: 1}]", "increasing"),
    ("drafter: early_exit\nrows: [{max_batch: 4, draft_length: 2}]", "drafter early_exit"),
    ("drafter: ngram\nrows: [{max_batch: 4, draft_length: 40}]", "0..16"),
])
def test_a_bad_schedule_file_is_one_line_and_exit_2_at_serve(tmp_path, text, phrase):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    port = free_port()
    try:
        done = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--drafter", "ngram", "--port", str(port),
                               "--draft-schedule", str(path)], capture_output=True, text=True, timeout=300, check=False)
    finally:
        release_port(port)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    assert str(path) in done.stderr and phrase in done.stderr, done.stderr


def test_a_drafter_with_its_own_cache_catches_up_on_the_steps_the_schedule_left_undrafted(tmp_path):
    """quantized_self drafts from a cache of its own; steps of two (k = 0) do not run it. A alone drafts, runs
    with B (plain steps) until B ends, then drafts again: its draft cache must then hold A's tokens as one
    prefill of them writes them, not the gaps of the plain steps."""
    schedule = {"drafter": "quantized_self", "rows": [{"max_batch": 1, "draft_length": 4},
                                                      {"max_batch": 2, "draft_length": 0}]}
    path = DraftSchedule.model_validate(schedule).dump(tmp_path / "s.yaml")
    engine = Engine(EngineConfig(drafter="quantized_self", draft_length=4, verify_slots=2, max_seq_len=128,
                                 threads=2, draft_schedule=str(path)))
    ids = engine.tokenizer.encode(PROMPTS[0])
    done = {name: threading.Event() for name in "AB"}
    tokens = {name: [] for name in "AB"}

    def collect(name):
        def on_event(event):
            tokens[name].extend(event.new_token_ids)
            if event.finish_reason:
                done[name].set()
        return on_event

    # Queued before the loop starts: A is admitted and prefilled first and decodes one step alone, then B joins.
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=40, ignore_eos=True)), collect("A"))
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=6, ignore_eos=True)), collect("B"))
    engine.start()
    try:
        assert all(event.wait(600) for event in done.values())
    finally:
        engine.stop()
    stats = engine.stats()
    assert stats["steps_by_batch"][2] >= 5 and stats["draft_tokens_by_batch"][2] == 0
    assert stats["draft_tokens_by_batch"][1] > 0
    # Every position but the last few (the last step's drafts may be wrong tokens) against one prefill into slot 1.
    history = ids + tokens["A"]
    known = len(history) - 12
    draft = engine.drafter.prefill_forward
    draft(torch.tensor([history[:known]]), torch.arange(known)[None], torch.tensor([1]), draft.cache.max_len,
          logits_from=known - 1)
    for layer in (0, len(draft.cache.k) - 1):
        caught_up, reference = draft.cache.k[layer][0, :, :known], draft.cache.k[layer][1, :, :known]
        # int8 forwards of other widths round differently; a gap left unfed (zeros, or stale drafts) is off by O(1)
        error = (caught_up - reference).norm(dim=-1) / reference.norm(dim=-1)  # per head and position
        assert error.amax() < 0.05, error.amax(0)


class RecordingNgramDrafter(NgramDrafter):
    """The engine's n-gram drafter, noting what each decode step asks of it: every step's input passes through
    host_proposals, so its notes are the step's work besides the forward: the lookups (one per row of k > 0),
    whether the stop rule's risk is read and the target's signals computed (which also takes a greedy step off
    the host path on a GPU)."""

    def __init__(self, drafter: NgramDrafter):
        super().__init__(drafter.ngram_min, drafter.ngram_max)
        self.steps = []

    def host_proposals(self, step):
        drafts, proposed = super().host_proposals(step)
        self.steps.append({"batch": len(proposed), "lookups": sum(k > 0 for k in step.draft_lengths),
                           "proposed": sum(proposed), "stop_rule": step.stop_above is not None,
                           "target_signals": step.target_signals is not None, "greedy_on_host": step.greedy_on_host})
        return drafts, proposed


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "estimator"])
def test_a_step_the_schedule_caps_to_no_draft_does_the_work_of_a_plain_step(tmp_path, policy):
    """Three requests of k = 8 together under a schedule that drafts nothing at batch >= 2, against the same three
    at k = 0: each step of two or three does the same work in both, counted (the drafter's lookups and proposals,
    the stop rule's signals, the tokens each forward feeds the target). The estimator's n-gram stop rule is where
    a capped step used to differ: it still computed the target's signals every step, for no draft."""
    schedule = {"drafter": "ngram", "rows": [{"max_batch": 1, "draft_length": 4}, {"max_batch": 8, "draft_length": 0}]}
    estimator = tmp_path / "estimator.json"
    estimator.write_text(json.dumps({"feature": "prompt_tokens", "thresholds": [], "temperature_edges": [],
                                     "k_table": [[8]], "stop_rule": {"signal": "entropy", "temperature_edges": [],
                                                                     "thresholds": [5.0]}}))
    engine = Engine(EngineConfig(
        drafter="ngram", draft_length=8, verify_slots=4, max_seq_len=256, threads=2, draft_policy=policy,
        draft_estimator=str(estimator) if policy == "estimator" else None,
        draft_schedule=str(DraftSchedule.model_validate(schedule).dump(tmp_path / "s.yaml"))))
    engine.drafter = drafter = RecordingNgramDrafter(engine.drafter)
    forwards = []  # [batch, tokens] of each forward of the target
    engine.target.model.register_forward_hook(lambda model, args, out: forwards.append(tuple(args[0].shape)))
    engine.start()
    try:
        work = {arm: run_together(engine, drafter, forwards, draft_length) for arm, draft_length in
                (("plain", 0), ("capped", None))}
    finally:
        engine.stop()
    for arm, (steps, widths) in work.items():
        assert {3, 2} <= {s["batch"] for s in steps}, (arm, steps)  # the three ran together, then two
        assert widths == [1] * len(steps), (arm, widths)  # one forward a step, one token a row
    plain, capped = ([{k: v for k, v in s.items() if k != "batch"} for s in steps] for steps, _ in work.values())
    assert plain[0] == {"lookups": 0, "proposed": 0, "stop_rule": False, "target_signals": False, "greedy_on_host": True}
    assert all(s == plain[0] for s in plain + capped), capped


def run_together(engine, drafter, forwards, draft_length) -> tuple[list[dict], list[int]]:
    """Three requests at once (draft_length None: the engine's own k); the drafter's notes of the steps of two or
    more rows, and the tokens per row of the target's forwards of two or more rows (prefill feeds one row)."""
    drafter.steps.clear()
    forwards.clear()
    done = [threading.Event() for _ in PROMPTS]
    for prompt, event in zip(PROMPTS, done):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, draft_length=draft_length)
        engine.submit(GenerationRequest(engine.tokenizer.encode(prompt), params),
                      lambda e, event=event: e.finish_reason and event.set())
    assert all(event.wait(600) for event in done)
    return [s for s in drafter.steps if s["batch"] > 1], [width for batch, width in forwards if batch > 1]
