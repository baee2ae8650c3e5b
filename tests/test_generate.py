"""Hugging Face ``generate`` through capturepass's captures: greedy tokens equal to eager's.

Generation is where a captured graph meets a caller's state: a static KV cache is written in
place at every step (``index_copy_`` into buffers the caller keeps), a dynamic cache grows
(a new shape at every step), and assisted generation runs a target and a draft model of one
class, which Dynamo serves with one graph (capturepass keeps their captures apart per
instance). On the CPU the captures run on host graphs (``tests.helpers.capture_on_host``:
capturepass's real replay path, the graphs' kernels run again on the captured memory); the
GPU test captures CUDA graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from capturepass.testing import zoo

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


def _generate(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    # On a GPU, generate with a static cache compiles its decode steps itself (Inductor's
    # reduce-overhead) unless told not to: only a given compile_config may compile here.
    kwargs.setdefault("disable_compile", "compile_config" not in kwargs)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)


def _compile_forward(model: torch.nn.Module, **options) -> None:
    """``generate`` calls ``model(...)``: its ``forward`` is what gets compiled."""
    model.forward = torch.compile(model.forward, backend="capturepass", options=options)


@pytest.mark.parametrize("name", ("llama", "qwen2_moe", "gemma3", "llama/flex_attention"))
@pytest.mark.parametrize("cache", ("static", "dynamic"))
def test_generate_through_host_captures(name: str, cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three generations (one prompt twice, then another), each equal to eager's tokens. Gemma 3's
    static cache holds a sliding-window layer beside a global one: its window's length counter,
    a tensor written in place at every step, picks the index the next step writes, and its
    Python-side length reaches the graphs as a host int. ``llama/flex_attention`` attends with
    ``flex_attention`` (a higher-order op; the block mask ``generate`` builds for each step reaches
    the graphs as eight tensors)."""
    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    name, _, attn = name.partition("/")
    model, make_inputs = zoo.build(name, attn=attn or "eager")
    prompts = [make_inputs(seed)["input_ids"][:, :6] for seed in (0, 0, 1)]
    implementation = {"cache_implementation": "static"} if cache == "static" else {}
    want = [_generate(model, ids, **implementation) for ids in prompts]
    _compile_forward(model, inner="eager", verify=True, cudagraphs="monolithic")
    counts = []
    for call, (ids, tokens) in enumerate(zip(prompts, want)):
        del log[:]
        got = _generate(model, ids, **implementation)
        assert torch.equal(got, tokens), f"{name}, {cache} cache, generation {call}: {got.tolist()} != {tokens.tolist()}"
        counts.append(([k for k, _ in log].count("capture"), [k for k, _ in log].count("replay")))
    if attn:
        # Each step's block mask is eight small tensors made per step, outside the graph: a call
        # that finds one where the last call had it (a block the allocator handed back) captures
        # it in place, a capture more, so the allocator decides the count of captures.
        assert all(replays for _, replays in counts), counts
    elif cache == "static" and name != "gemma3":
        # Each generation makes a new cache (the compiled prefill allocates it). The first is
        # captured in place: a capture per graph, then every decode step replays. From the
        # second on, the decode graph's first call finds the cache moved and captures copying
        # it, the next finds it where it was and captures it in place again (no copy of the
        # cache per step), the rest replay; the prefill graph, called once a generation, copies
        # it (a capture at the second generation). At the third its capture replays where the
        # new cache's static tensors (its length counters, whose addresses key a capture) took
        # the blocks the second generation's freed, and captures once more where they did not:
        # the allocator's reuse of freed memory decides.
        assert counts[:2] == [(2, NEW_TOKENS - 2), (3, NEW_TOKENS - 3)], counts
        assert counts[2] in ((2, NEW_TOKENS - 2), (3, NEW_TOKENS - 3)), counts
    elif cache == "static":
        # The sliding window's graphs take its length as a host int, which a graph holds: a
        # capture per value. Once three captures in a row of a graph were made for values no
        # replay came back to, new values run uncaptured; the values captured still replay (at
        # the third generation, once more captured where the new cache's counters did not take
        # the freed blocks of the last one's, as above).
        assert counts[:2] == [(6, 0), (2, 0)], counts
        assert counts[2] in ((1, 2), (2, 1)), counts
    else:
        # The cache grows a step at a time: the shapes of the first generation come back.
        assert all(replays for _, replays in counts[1:]), counts


def test_generate_compiles_its_decode_steps_with_capturepass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's own route: ``generate`` with a static cache compiles the decode steps itself
    with the ``CompileConfig`` it is given (the prefill runs eagerly and marks the new cache's
    tensors static). Each generation makes a new cache: its first decode step captures (the old
    capture goes with its cache), the others replay."""
    import transformers

    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    model, make_inputs = zoo.build("llama")
    config = transformers.CompileConfig(backend="capturepass", mode=None,
                                        options={"inner": "eager", "verify": True, "cudagraphs": "monolithic"})
    config._compile_all_devices = True  # Hugging Face compiles on accelerators only, unless told
    for call, seed in enumerate((0, 1, 0)):
        ids = make_inputs(seed)["input_ids"][:, :6]
        want = _generate(model, ids, cache_implementation="static")
        del log[:]
        got = _generate(model, ids, cache_implementation="static", compile_config=config)
        assert torch.equal(got, want), f"generation {call}: {got.tolist()} != {want.tolist()}"
        kinds = [k for k, _ in log]
        assert (kinds.count("capture"), kinds.count("replay")) == (1, NEW_TOKENS - 2), kinds


def test_generate_with_hugging_faces_default_compile_config() -> None:
    """``CompileConfig(backend="capturepass")`` as it comes: its default ``mode="reduce-overhead"``
    reaches the backend, which takes it for its own default options (Inductor inside; on the CPU
    nothing is captured)."""
    import transformers

    model, make_inputs = zoo.build("llama")
    config = transformers.CompileConfig(backend="capturepass")
    assert config.mode == "reduce-overhead"
    config._compile_all_devices = True  # Hugging Face compiles on accelerators only, unless told
    for call, seed in enumerate((0, 1)):
        ids = make_inputs(seed)["input_ids"][:, :6]
        want = _generate(model, ids, cache_implementation="static")
        got = _generate(model, ids, cache_implementation="static", compile_config=config)
        assert torch.equal(got, want), f"generation {call}: {got.tolist()} != {want.tolist()}"


def test_assisted_generation_keeps_target_and_draft_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target and a draft Llama (one class, other weights) both compiled: Dynamo gives both one
    graph, and a draft's capture replayed for the target would verify the draft's own tokens.
    Greedy assisted generation must give the target's own greedy tokens."""
    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    target, make_inputs = zoo.build("llama")
    draft, _ = zoo.build("llama")
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = make_inputs(0)["input_ids"][:1, :6]
    want = _generate(target, ids)
    assert not torch.equal(_generate(draft, ids), want)  # a draft that would be caught out
    for model in (target, draft):
        _compile_forward(model, inner="eager", verify=True, cudagraphs="monolithic")
    for call in range(2):
        got = _generate(target, ids, assistant_model=draft)
        assert torch.equal(got, want), f"assisted generation {call}: {got.tolist()} != {want.tolist()}"
    kinds = [k for k, _ in log]
    assert kinds.count("capture") >= 4 and kinds.count("replay") >= 1, kinds


def _gemma4_with_assistant(device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Gemma 4 text model and its assistant (a draft that reads the target's last hidden
    state and its key/value states, shared with it), random weights, float32."""
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=16, vocab_size=512, max_position_embeddings=128,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with torch.random.fork_rng(), torch.device(device):
        torch.manual_seed(0)
        target = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
            **common, vocab_size_per_layer_input=512, hidden_size_per_layer_input=16)).eval()
        draft = transformers.Gemma4AssistantForCausalLM(transformers.Gemma4AssistantConfig(
            text_config=transformers.Gemma4TextConfig(
                **common, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2),
            backbone_hidden_size=64, num_centroids=16, centroid_intermediate_top_k=4)).eval()
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return target, draft


@contextlib.contextmanager
def _drafts_of(draft: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Records the draft's next-token logits at every call of its ``forward`` inside the block."""
    seen: list[torch.Tensor] = []
    forward = draft.forward

    def recorded(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.logits[:, -1].detach().clone())
        return out

    draft.forward = recorded
    try:
        yield seen
    finally:
        draft.forward = forward


def _assisted_by_gemma4_assistant(device: str, **options) -> None:
    """Greedy generation assisted by Gemma 4's assistant, both models compiled with ``options``:
    the target's tokens and every logit the draft proposed from are eager's (the tokens alone
    would be the target's greedy ones whatever the draft proposed)."""
    target, draft = _gemma4_with_assistant(device)
    ids = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(0)).to(device)
    with _drafts_of(draft) as want_drafts:
        want = _generate(target, ids, assistant_model=draft)
    assert want_drafts, "the draft was never called"
    _compile_forward(target, **options)
    _compile_forward(draft, **options)
    for call in range(2):
        with _drafts_of(draft) as got_drafts:
            got = _generate(target, ids, assistant_model=draft)
        assert torch.equal(got, want), f"assisted generation {call}: {got.tolist()} != {want.tolist()}"
        assert len(got_drafts) == len(want_drafts), (len(got_drafts), len(want_drafts))
        for step, (g, w) in enumerate(zip(got_drafts, want_drafts)):
            torch.testing.assert_close(g, w, **zoo.TOLERANCE[device],
                                       msg=lambda m, step=step: f"generation {call}, draft call {step}: {m}")


def test_assisted_generation_with_a_draft_that_reads_the_targets_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 4's assistant drafts from the target's last hidden state and reads the target's
    key/value states, which the target writes in place between the draft's calls: inputs a
    capture must read where they are, as they are at each call. On host graphs."""
    from tests.helpers import capture_on_host

    log = capture_on_host(monkeypatch.setattr)
    _assisted_by_gemma4_assistant("cpu", inner="eager", verify=True, cudagraphs="monolithic")
    kinds = [k for k, _ in log]
    assert kinds.count("capture") >= 4 and kinds.count("replay") >= 1, kinds


@pytest.mark.parametrize("name", ("llama", "mistral"))
def test_the_measured_choice_replays_a_static_cache_from_what_the_call_read(
        name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU each capture shape's schedule candidates are captured and replayed to be timed.
    A static cache's graphs read what they write (its length counter, a tensor bumped in place,
    picks where a step writes): replayed one after another they walked it past the cache's end,
    an index out of bounds (on the GPU a device-side assert, which ends the process). Here the
    candidates are measured as on a GPU, over host graphs: every shape is measured, no timing or
    capture fails, the tokens are eager's. Mistral's sliding window (8 slots) also takes its
    length as a host int, and its counter reaches the other candidates through an input buffer,
    which holds what the call read."""
    import logging

    from capturepass.testing.host_graphs import measure_on_host
    from tests.helpers import capture_on_host

    capture_on_host(monkeypatch.setattr)
    measure_on_host(monkeypatch.setattr)
    model, make_inputs = zoo.build(name)
    prompts = [make_inputs(seed)["input_ids"][:, :6] for seed in (0, 1)]
    want = [_generate(model, ids, cache_implementation="static") for ids in prompts]
    _compile_forward(model, cudagraphs="monolithic", regions="fused", verify=True)
    with caplog.at_level(logging.INFO, logger="capturepass"):
        for call, (ids, tokens) in enumerate(zip(prompts, want)):
            got = _generate(model, ids, cache_implementation="static")
            assert torch.equal(got, tokens), f"generation {call}: {got.tolist()} != {tokens.tolist()}"
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "failed" in m], [m for m in messages if "failed" in m]
    chosen = [m for m in messages if ": chose schedule " in m]
    # The prefill shape and the decode shape, measured at each generation's new cache.
    shapes = {m.split(", shape ")[1].split("): ")[0] + ")" for m in chosen}
    if name == "llama":
        assert shapes >= {
            "(int64[2, 6], int64[2, 6], float32[2, 1, 6, 13], int64[])",
            "(int64[2, 1], int64[2, 1], float32[2, 1, 1, 13], int64[], float32[2, 2, 13, 16], float32[2, 2, 13, 16])"
        }, chosen
    else:  # a decode shape per window length the host int took
        assert len(shapes) >= 4, chosen


@pytest.mark.gpu
def test_assisted_generation_with_a_draft_that_reads_the_targets_states_gpu(no_tf32: None) -> None:
    """The same on real CUDA graphs, default options."""
    _assisted_by_gemma4_assistant("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ("llama", "qwen2_moe", "deepseek_v3"))
def test_generate_with_a_static_cache_gpu(name: str, no_tf32: None) -> None:
    """Real CUDA graphs, default options: two generations and one on another prompt, float32,
    each equal to eager's tokens, the decode steps replayed from captures."""
    from capturepass.backends.compile import last_compiled
    from tests.helpers import compiled_since

    model, make_inputs = zoo.build(name, device="cuda")
    prompts = [make_inputs(seed)["input_ids"][:, :6] for seed in (0, 0, 1)]
    want = [_generate(model, ids, cache_implementation="static") for ids in prompts]
    before = last_compiled()
    _compile_forward(model)
    for call, (ids, tokens) in enumerate(zip(prompts, want)):
        got = _generate(model, ids, cache_implementation="static")
        assert torch.equal(got, tokens), f"{name}, generation {call}: {got.tolist()} != {tokens.tolist()}"
    executors = [g.executor for g in compiled_since(before) if g.executor is not None]
    assert any(ex._captures for ex in executors), "nothing was captured"
