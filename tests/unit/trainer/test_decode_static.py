"""The decoder's static KV caches and CUDA graphs. On any machine: verify steps with rejected
drafts, tree gathers and cache growth give the logits of plain forwards; EAGLE-3 chain drafts on
the head's static cache are those of the concatenating path training uses; no CUDA graph is
touched on a CPU; a step that cannot be captured runs eagerly. On a GPU: graphed decoding gives
eager decoding's tokens, captures each step once across requests, and one request per model
owns its cache. (Greedy decoding on the static cache equals transformers' `generate` on its
dynamic one: test_decode_greedy, test_decode_smollm2.)"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.decode import (
    SHAPES,
    chain_logits,
    chaotic_target,
    features,
    from_scratch,
    medusa_drafter,
    path_to,
    position_sensitive_head,
    random_eagle3_head,
)
from trainer.decoding import (
    Chain,
    Eagle3Drafter,
    MedusaDrafter,
    Sampling,
    greedy_generate,
    speculative_generate,
)
from trainer.decoding import graphs as graphs_module
from trainer.decoding.graphs import StepGraphs
from trainer.decoding.kv_cache import TargetKV, capacity_for
from trainer.decoding.tree import chain_parents

pytestmark = pytest.mark.usefixtures("single_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW = 24


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


@torch.no_grad()
def test_rollbacks_gathers_and_growth_give_plain_forward_logits():
    target = chaotic_target("qwen2", layers=2)
    rng = random.Random(0)
    seq = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(0))
    kv = TargetKV(target, [1])
    kv.prefill(seq)
    capacities = {kv.cache.capacity}
    while seq.numel() < 140:
        n = rng.randint(1, 6)
        tokens = torch.tensor([rng.randrange(256) for _ in range(n)])
        parents = None if rng.random() < 0.5 else random_tree(rng, n)
        logits, hidden = kv.forward(tokens, parents)
        for node in range(n):
            path = path_to(parents or chain_parents(n), node)
            ref = target(torch.cat([seq, tokens[path]])[None], output_hidden_states=True)
            torch.testing.assert_close(logits[node], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[0][node], ref.hidden_states[1][0, -1], atol=1e-4, rtol=1e-4)
        accepted = path_to(parents or chain_parents(n), rng.randrange(n))
        kv.keep(accepted)
        seq = torch.cat([seq, tokens[accepted]])
        capacities.add(kv.cache.capacity)
    assert kv.length == seq.numel()
    assert capacities == {64, 128, 192}  # grown twice, the committed entries carried over


def test_capacity_is_tight_eager_and_a_few_sizes_with_graphs():
    assert [capacity_for(n, graphed=False) for n in (1, 64, 65)] == [64, 64, 128]
    assert [capacity_for(n, graphed=True) for n in (1, 1024, 1025)] == [1024, 1024, 2048]


@torch.no_grad()
def test_eagle3_chain_drafts_follow_the_concatenating_path():
    target = chaotic_target("llama")
    head = position_sensitive_head(target)
    drafter = Eagle3Drafter(head)
    seq, nxt = torch.arange(3, 14), 7
    drafter.start(seq, features(target, head, seq), nxt)
    draft = drafter.propose(Chain(4), Sampling()).tokens.tolist()
    hidden, logits, kv = from_scratch(target, head, seq, nxt)
    expected = [int(logits[0, -1].argmax())]
    while len(expected) < 4:
        expected.append(int(chain_logits(head, hidden[:, -1:], kv, seq.numel(), expected).argmax()))
    assert draft == expected


def test_no_cuda_graph_is_touched_on_a_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CUDA graph on a CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    target = chaotic_target("llama")
    drafters = [Eagle3Drafter(random_eagle3_head(target)), medusa_drafter(target)]
    prompt = torch.arange(5, 17)
    plain = greedy_generate(target, prompt, 8).tokens
    for drafter in drafters:
        for shape in SHAPES:
            assert speculative_generate(target, drafter, prompt, 8, shape).tokens == plain
        assert not drafter.graphs.enabled and len(drafter.graphs) == 0
    assert not TargetKV(target, []).graphs.enabled


def decode_all(target, drafters, prompt) -> list[list[int]]:
    runs = [greedy_generate(target, prompt, NEW).tokens]
    for drafter in drafters:
        runs += [speculative_generate(target, drafter, prompt, NEW, shape).tokens for shape in SHAPES]
    return runs


@cuda
def test_graphed_decoding_equals_eager_decoding(monkeypatch):
    target = chaotic_target("llama").cuda()
    eagle3, medusa = random_eagle3_head(target).cuda(), medusa_drafter(target).head.cuda()
    layers, prompt = target.config.num_hidden_layers, torch.arange(5, 30)

    def drafters():
        return [Eagle3Drafter(eagle3), MedusaDrafter(medusa, layers)]

    graphed_drafters = drafters()
    graphed = decode_all(target, graphed_drafters, prompt)
    target_graphs = TargetKV(target, []).graphs
    captured = (len(target_graphs), *(len(d.graphs) for d in graphed_drafters))
    assert target_graphs.enabled and min(captured) > 0
    assert decode_all(target, graphed_drafters, prompt) == graphed
    assert (len(target_graphs), *(len(d.graphs) for d in graphed_drafters)) == captured
    assert all(run == graphed[0] for run in graphed)  # lossless with graphs too

    monkeypatch.setattr(graphs_module, "graphs_enabled", lambda device: False)
    assert decode_all(target, drafters(), prompt) == graphed


@cuda
def test_a_step_graph_replays_new_inputs_against_fixed_buffers():
    buffer = torch.zeros(4, device="cuda")

    def step(value, slot):
        buffer.index_copy_(0, slot, value)
        return buffer * 2

    graphs = StepGraphs(torch.device("cuda"))
    for value, slot in ((1.0, 0), (5.0, 2)):
        out = graphs("step", step, torch.tensor([value], device="cuda"), torch.tensor([slot], device="cuda"))
    assert out.tolist() == [2.0, 0.0, 10.0, 0.0] and len(graphs) == 1


def routed(x: torch.Tensor) -> torch.Tensor:
    """A step like an MoE expert loop: `nonzero` reads the routing back to the host."""
    return x[x.nonzero(as_tuple=True)] * 2


CAPTURE_REFUSED = "CUDA error: operation not permitted when stream is capturing"


def test_a_step_that_cannot_be_captured_runs_eagerly_after_one_line(capsys):
    """CUDA cannot exist on this machine: the capture is a stand-in that raises CUDA's error for
    a host read during capture (what `routed` does on a GPU). The step's outputs are the eager
    ones; one line names it; neither it (under any shape) nor a later failure is tried or said
    again, while the graphs stay enabled for what can be captured."""
    tries = []

    def refused(fn, inputs):
        tries.append(fn)
        raise RuntimeError(f"{CAPTURE_REFUSED}\nCUDA kernel errors might be asynchronously reported")

    graphs = StepGraphs(torch.device("cuda"), capture=refused)
    for x in (torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 0.0, 0.0]), torch.zeros(5)):
        assert torch.equal(graphs("experts", routed, x), routed(x))
    assert torch.equal(graphs("other", routed, torch.ones(2)), torch.full((2,), 2.0))
    assert len(tries) == 2 and len(graphs) == 0 and graphs.enabled
    assert capsys.readouterr().err.splitlines() == [
        f"cuda graphs: step 'experts' cannot be captured ({CAPTURE_REFUSED}); it runs eagerly"
    ]


@cuda
def test_a_refused_capture_leaves_the_stream_as_it_was(capsys):
    """On a GPU, the real refusal: the caller's stream is current again and nothing captures;
    the step's output is eager decoding's, and a capturable step is still captured."""
    graphs, x = StepGraphs(torch.device("cuda")), torch.tensor([0.0, 1.0, 2.0], device="cuda")
    stream = torch.cuda.current_stream()
    assert torch.equal(graphs("experts", routed, x), routed(x))
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    assert "cuda graphs: step 'experts' cannot be captured (" in capsys.readouterr().err
    assert torch.equal(graphs("double", torch.mul, x, torch.tensor(2.0, device="cuda")), x * 2)
    assert len(graphs) == 1


@cuda
def test_a_newer_request_on_the_model_takes_its_cache_over():
    target = chaotic_target("llama").cuda()
    first = TargetKV(target, [])
    first.prefill(torch.arange(5, 17))
    TargetKV(target, [])
    with pytest.raises(RuntimeError, match="another request"):
        first.forward(torch.tensor([3]))
