"""AdaptiveDepth decides from measured goodput, per batch-size bucket, one depth per step for
rows with deterministic drafts; stochastic rows keep a row-local depth."""

import functools
import itertools

import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.engine import depth
from mlx_tandem.engine.depth import (
    PROBE,
    PROBE_MAX,
    PROBE_SHARE,
    RECALIBRATE,
    AdaptiveDepth,
    DraftCost,
    FixedDepth,
    size_bucket,
)
from mlx_tandem.engine.request import new_request
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model


@functools.cache
def tiny():
    import tempfile
    from pathlib import Path

    return load_folder(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "m"), "tiny")


def rows(n, alpha=None, temperature=0.0):
    out = []
    for i in range(n):
        p = SamplingParams(max_tokens=1000, temperature=temperature, seed=i)
        r = new_request(tiny(), [1, 2, 3], p)
        r.spec_alpha = alpha
        if alpha is not None:  # a measured row has been asked to draft before
            r.spec_offer = 1.0
        out.append(r)
    return out


def calibrate(policy, requests, plain_s, per_token_s, k=3):
    """Teach the policy one bucket's costs: a plain step, then a step drafting k tokens."""
    B = len(requests)
    alphas = [r.spec_alpha for r in requests]
    seen = policy.seen_alpha, policy.seen_offer
    policy.observe(requests, [0] * B, [0] * B, 0.0, plain_s, 1)
    for _ in range(20):
        policy.observe(requests, [k] * B, [0] * B, 0.0, plain_s + k * per_token_s, k + 1)
    for r, a in zip(requests, alphas, strict=True):  # keep the rows' acceptance as set
        r.spec_alpha = a
    policy.seen_alpha, policy.seen_offer = seen  # and what new rows are assumed to do


def test_buckets():
    assert [size_bucket(n) for n in (1, 2, 3, 5, 12, 13, 16, 17, 100)] == [
        1, 2, 4, 8, 12, 16, 16, 24, 128]


def test_cheap_drafts_draft_deep_and_costly_drafts_turn_drafting_off():
    policy = AdaptiveDepth(4)
    assert policy.shared_depth([0.8] * 4, c=0.05) == 4
    assert policy.shared_depth([0.8] * 4, c=1.0) == 0
    assert policy.shared_depth([0.1] * 4, c=0.1) == 0
    # one row's high acceptance does not buy a wide verify for fifteen rows that reject
    assert policy.shared_depth([0.9] + [0.05] * 15, c=0.3) == 0


def test_depth_is_decided_per_batch_size_from_measured_costs():
    policy = AdaptiveDepth(4)
    one, sixteen = rows(1, alpha=0.7), rows(16, alpha=0.7)
    calibrate(policy, one, plain_s=0.080, per_token_s=0.004)  # memory-bound: wide is ~free
    calibrate(policy, sixteen, plain_s=0.170, per_token_s=0.160)  # compute-bound
    policy.steps = 1
    assert policy.depths(one)[0] >= 2
    assert policy.depths(sixteen) == [0] * 16


def test_a_new_bucket_and_every_recalibration_take_a_plain_step():
    policy = AdaptiveDepth(4)
    eight = rows(8, alpha=0.9)
    assert policy.depths(eight) == [0] * 8  # bucket 8 not measured yet
    calibrate(policy, eight, plain_s=0.1, per_token_s=0.001)
    policy.steps = RECALIBRATE - 1
    assert policy.depths(eight) == [0] * 8  # step RECALIBRATE
    assert max(policy.depths(eight)) > 0


def test_when_drafting_is_off_all_rows_probe_together():
    policy = AdaptiveDepth(4)
    sixteen = rows(16, alpha=0.6)
    calibrate(policy, sixteen, plain_s=0.170, per_token_s=0.170)
    seen = []
    for _ in range(2 * PROBE):
        seen.append(policy.depths(sixteen))
    widths = {max(d) for d in seen}
    assert widths <= {0, 1}
    assert all(len(set(d)) == 1 for d in seen)  # never a ragged probe
    assert sum(max(d) for d in seen) <= 2  # probes, not drafting


def test_failed_probes_back_off_and_drafting_resets_the_interval():
    policy = AdaptiveDepth(4)
    sixteen = rows(16, alpha=0.05)
    calibrate(policy, sixteen, plain_s=0.170, per_token_s=0.170)
    probes = [step for step in range(1, 1200) if max(policy.depths(sixteen))]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    first = max(PROBE, round(1.0 / PROBE_SHARE))  # c = 1: a probe costs a whole step
    assert gaps[0] <= first + 2 and max(gaps) <= PROBE_MAX + 2  # recalibrations interleave
    assert gaps[-1] > 4 * PROBE  # backed off
    assert len(probes) < 1200 // PROBE // 3
    for r in sixteen:  # the rows start to accept: drafting turns on, probing resets
        r.spec_alpha = 0.95
    calibrate(policy, sixteen, plain_s=0.170, per_token_s=0.005)
    assert max(policy.depths(sixteen)) > 0 and policy.probe_every == PROBE


@pytest.mark.parametrize("c", [0.05, 0.3, 0.74, 1.0])
def test_probes_never_cost_more_than_their_share_of_the_time(c):
    """Chat that never drafts: over 2,000 steps the probes' extra cost (c plain steps each)
    stays under PROBE_SHARE of the time at any batch width; the old fixed interval (every
    PROBE steps at first) did not at c = 0.74 (32 rows here)."""
    policy = AdaptiveDepth(4)
    many = rows(32, alpha=0.05)
    calibrate(policy, many, plain_s=0.2, per_token_s=0.2 * c)
    probes = [step for step in range(1, 2001) if max(policy.depths(many))]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes and min(gaps) >= c / 0.02 - 1, gaps  # the claim: 2% (PROBE_SHARE)
    assert len(probes) * c <= 0.02 * 2000 + c


def test_new_rows_start_from_what_recent_rows_did():
    """Chat whose drafts are rejected: once earlier rows have shown it, a new batch of rows
    (nothing measured of them yet) does not draft at a cost where the optimistic prior
    (0.6) would; with the prior kept fixed it would (the negative control)."""
    policy = AdaptiveDepth(4)
    old = rows(8, alpha=None)
    calibrate(policy, old, plain_s=0.1, per_token_s=0.03)
    for _ in range(30):  # the old rows draft and see every draft rejected
        policy.depths(old)
        policy.observe(old, [2] * 8, [0] * 8, 0.0, 0.16, 3)
    new = rows(8, alpha=None)
    policy.steps = 1
    assert policy.depths(new) == [0] * 8  # the old rows left: they set the new rows' start
    fixed = AdaptiveDepth(4)
    calibrate(fixed, rows(8, alpha=None), plain_s=0.1, per_token_s=0.03)
    fixed.steps = 1
    assert max(fixed.depths(rows(8, alpha=None))) > 0


def test_drafting_cost_starts_from_a_measurement_not_zero():
    policy = AdaptiveDepth(4)
    many = rows(32, alpha=0.6)
    policy.observe(many, [0] * 32, [0] * 32, 0.0, 0.3, 1)  # the bucket's plain step
    policy.steps = 1
    assert policy.depths(many) == [1] * 32  # unmeasured: one token, not k_max on a free guess
    policy.observe(many, [1] * 32, [0] * 32, 0.01, 0.55, 2)  # a drafted token costs ~0.85
    assert abs(policy.costs[32].fit(1).per_token_s - 0.26) < 1e-9
    assert policy.depths(many) == [0] * 32


def test_stochastic_rows_ignore_the_engines_measurements():
    policy = AdaptiveDepth(4)
    sampled = rows(4, alpha=0.9, temperature=0.8)
    calibrate(policy, sampled, plain_s=0.1, per_token_s=1.0)  # drafting looks ruinous
    policy.steps = 1
    mine = policy.depths(sampled, stochastic=True)
    fresh = AdaptiveDepth(4)
    assert mine == fresh.depths(sampled, stochastic=True)  # the row's own history only
    assert min(mine) > 0


def test_rows_that_propose_nothing_do_not_make_drafting_cost():
    """Prompt lookup finds nothing on most chat rows: they never measure an acceptance, and
    a verify runs its projections on their real slot only (kv/attention.Ragged), so they
    cost nearly nothing. The policy measures the cost per drafted token, charges a depth by
    the share of rows that propose, keeps drafting for the one row that proposes while its
    drafts are accepted, and stops once they are rejected."""
    policy = AdaptiveDepth(4)
    chat = rows(16)
    calibrate(policy, chat, plain_s=0.170, per_token_s=0.05)
    for r in chat:
        r.spec_alpha = None

    def run(accepted: bool) -> list[int]:
        for _ in range(30):  # asked to draft, one row in sixteen proposes
            asked = policy.depths(chat)
            drafted = [k if i == 0 else 0 for i, k in enumerate(asked)]
            kept = drafted if accepted else [0] * 16
            policy.observe(chat, drafted, kept, 0.0, 0.17 + 0.05 * sum(drafted) / 16,
                           max(drafted) + 1)
            if policy.steps % RECALIBRATE == RECALIBRATE - 1:
                policy.steps += 1  # stay off the recalibration steps
        policy.steps = 2
        return policy.depths(chat)

    assert max(run(True)) > 0
    assert chat[1].spec_offer < 0.2 and chat[1].spec_alpha is None
    assert abs(policy.costs[16].fit(1).per_token_s - 0.05) < 1e-6  # per drafted token, all rows
    assert max(run(False)) == 0


def test_a_drafted_steps_own_cost_is_fitted_apart_from_its_tokens():
    """A drafted step costs f + t * x (x: drafted tokens per row). Steps with different x fit
    both; read per token only (one x seen), a step where few rows propose would charge its
    fixed part to those few tokens (the negative control: five times dearer here)."""
    costs = DraftCost()
    for x in [0.1, 1.0, 0.1, 2.0, 0.5] * 4:
        costs.add(x, 0.02 + 0.05 * x, 0.2)
    assert abs(costs.fixed_s - 0.02) < 1e-6 and abs(costs.per_token_s - 0.05) < 1e-6
    one = DraftCost()
    one.add(0.1, 0.02 + 0.05 * 0.1, 0.2)
    assert one.fixed_s == 0 and one.per_token_s > 4.9 * 0.05
    policy = AdaptiveDepth(4)  # four copiers among 32 chat rows that seldom propose
    alphas, offers = [0.9] * 4 + [0.1] * 28, [1.0] * 4 + [0.05] * 28
    assert policy.shared_depth(alphas, costs.per_token_s / 0.3, offers, costs.fixed_s / 0.3) > 0
    assert policy.shared_depth(alphas, one.per_token_s / 0.3, offers) == 0


def test_a_step_that_takes_one_more_projection_call_is_priced_by_its_own_measurements():
    """With a row quantum of 30 (each projection call takes at most 30 rows), 8 rows drafting
    2 tokens each (24 slots) take one call per projection, drafting 3 (32 slots) two. Each
    call count has its own measured line: a depth is priced by the line of the calls it
    needs, so the policy stops at the depth below the jump where the jump does not pay;
    one line for every depth (quantum 0) extrapolates past the jump and drafts deeper
    (the negative control)."""
    def learned(quantum: int) -> AdaptiveDepth:
        policy = AdaptiveDepth(4, quantum=quantum)
        eight = rows(8, alpha=0.8)
        policy.observe(eight, [0] * 8, [0] * 8, 0.0, 0.10, 1)
        for k, step_s in [(1, 0.12), (2, 0.14), (3, 0.24), (4, 0.26), (1, 0.12), (2, 0.14),
                          (3, 0.24), (4, 0.26)] * 3:  # a second call per projection past 30
            policy.observe(eight, [k] * 8, [0] * 8, 0.0, step_s, k + 1)
        return policy

    eight = rows(8, alpha=0.9)
    for r in eight:
        r.spec_offer = 1.0
    piecewise = learned(30)
    assert set(piecewise.costs[8].drafted) == {1, 2}
    piecewise.steps = 1
    assert piecewise.depths(eight) == [2] * 8
    linear = learned(0)
    linear.steps = 1
    assert max(linear.depths(eight)) > 2


def test_one_rows_turned_verifies_are_priced_apart_from_its_plain_ones():
    """At one row, a verify of 2 or 3 slots runs its projections turned and costs about a
    plain step (+10%), 4 slots run as they are (+45%): the small turned verifies are a cost
    class of their own (pieces 0), so the policy drafts 2 (k = 3 does not pay even at 0.8
    acceptance); one line for all depths (no small class) prices k = 3 from the cheap k = 1
    and 2 and drafts 3 (the negative control)."""
    def learned(small: int) -> AdaptiveDepth:
        policy = AdaptiveDepth(3, quantum=30)
        policy.small = small
        one = rows(1, alpha=0.6)
        policy.observe(one, [0], [0], 0.0, 0.040, 1)
        for k, step_s in [(1, 0.043), (2, 0.046), (3, 0.060)] * 4:
            policy.observe(one, [k], [0], 0.0, step_s, k + 1)
        return policy

    one = rows(1, alpha=0.8)
    one[0].spec_offer = 1.0
    priced = learned(3)
    assert [priced.pieces(t) for t in (1, 2, 3, 4, 30, 31)] == [1, 0, 0, 1, 1, 2]
    assert set(priced.costs[1].drafted) == {0, 1}
    priced.steps = 1
    assert priced.depths(one) == [2]
    lumped = learned(0)
    lumped.steps = 1
    assert lumped.depths(one) == [3]


def test_a_new_row_is_asked_soon_and_its_accepted_drafts_turn_drafting_on():
    """After a long chat load, probes have backed off to PROBE_MAX steps and new rows start
    from chat's low acceptance. A new row (a grounded request) is asked at the next step
    the probe spacing allows, and its own accepted drafts turn drafting on within a few
    steps. Negative control: the same row marked as already asked waits for the backed-off
    schedule."""

    def backed_off():
        policy = AdaptiveDepth(4)
        chat = rows(1, alpha=0.05)
        calibrate(policy, chat, plain_s=0.1, per_token_s=0.01)
        for _ in range(2000):
            policy.depths(chat)
        policy.seen_alpha = 0.1
        assert policy.probe_every == PROBE_MAX
        return policy

    policy = backed_off()
    grounded = rows(1, alpha=None)
    asked = []
    for step in range(40):
        k = policy.depths(grounded)[0]
        if k:
            asked.append(step)
            policy.observe(grounded, [k], [k], 0.0, 0.1 + 0.01 * k, k + 1)
        else:
            policy.observe(grounded, [0], [0], 0.0, 0.1, 1)
    spacing = 0.1 / PROBE_SHARE  # c = 0.1 here
    assert asked and asked[0] <= spacing + 1
    assert len(asked) >= 20 and grounded[0].spec_alpha > 0.6  # drafting turned on and stays
    old = backed_off()
    known = rows(1, alpha=None)
    known[0].spec_offer = 0.0  # asked before: no early probe
    assert not any(old.depths(known)[0] for _ in range(40))


def test_a_new_batch_size_prices_drafts_as_the_nearest_measured_one():
    """A burst of requests fills and drains the cohort through many batch sizes. Once one
    size has priced its drafted steps, a new size borrows that price (in its own plain
    steps) instead of drafting a token on every row to measure it: chat whose drafts are
    rejected takes plain steps at the new size, copiers draft there. The negative control:
    with nothing priced anywhere, the first drafted step still measures (one token)."""
    policy = AdaptiveDepth(4)
    calibrate(policy, rows(32, alpha=0.05), plain_s=0.27, per_token_s=0.15)
    chat = rows(24, alpha=0.05)
    policy.observe(chat, [0] * 24, [0] * 24, 0.0, 0.22, 1)  # bucket 24: its plain step only
    policy.steps = 1
    assert policy.depths(chat) == [0] * 24
    copiers = rows(24, alpha=0.95)
    assert min(policy.depths(copiers)) > 0
    assert 24 not in {b for b, c in policy.costs.items() if c.drafted}
    fresh = AdaptiveDepth(4)
    fresh.observe(chat, [0] * 24, [0] * 24, 0.0, 0.22, 1)
    fresh.steps = 1
    assert fresh.depths(chat) == [1] * 24
    one = rows(1, alpha=0.05)  # one row is another regime than 32: measured, not borrowed
    policy.observe(one, [0], [0], 0.0, 0.06, 1)
    assert policy.depths(one) == [1]


@pytest.mark.parametrize("by_request", [True, False])
def test_the_slowest_rows_of_a_burst_do_not_set_the_next_rows_start(by_request):
    """Six rows whose drafts are accepted finish first; two whose drafts are rejected keep
    drafting (and observing) for many steps before they leave. A new burst starts from
    the mean of those eight requests (six good, two bad): it drafts. Counted per drafted
    step (by_request=False, the old rule: the negative control) the two slow rows' many
    rejections are all the new rows start from, and they do not draft."""
    policy = AdaptiveDepth(3, by_request=by_request)
    burst = rows(8, alpha=None)
    calibrate(policy, burst, plain_s=0.1, per_token_s=0.01)
    for _ in range(6):
        policy.depths(burst)
        policy.observe(burst, [3] * 8, [3] * 6 + [0] * 2, 0.0, 0.13, 4)
    slow = burst[6:]
    for _ in range(30):
        policy.depths(slow)
        policy.observe(slow, [3] * 2, [0] * 2, 0.0, 0.13, 4)
    new = rows(8, alpha=None)
    calibrate(policy, new, plain_s=0.1, per_token_s=0.01)
    policy.steps = 1
    drafts = max(policy.depths(new))
    assert (drafts > 0) == by_request, (policy.seen_alpha, drafts)


@pytest.mark.parametrize("copying", [True, False])
def test_rows_drafting_nothing_are_measured_by_their_shadows(copying):
    """A drafter with free proposals (prompt lookup's `propose`): rows that draft nothing are
    measured by checking its proposals against the tokens they then generate. Rows that
    started badly (acceptance 0.05, drafting off) but now copy their input turn drafting on
    with no probe; rows whose shadows miss stay off, and no probe ever drafts for them.
    The negative control: without the shadow the copiers' estimate never moves and they
    draft only when a probe comes."""

    def run(shadowed, steps=PROBE - 2):
        policy = AdaptiveDepth(3)
        group = rows(8, alpha=0.05)
        calibrate(policy, group, plain_s=0.1, per_token_s=0.01)
        if shadowed:
            policy.shadow = lambda reqs, depths: [[7] * d for d in depths]
        policy.steps = 1
        ks = []
        for _ in range(steps):
            k = max(policy.depths(group))
            ks.append(k)
            for r in group:  # a drafted step emits k + 1 tokens (all accepted when copying)
                r.tokens += [7 if copying else 8] * (k + 1)
            policy.observe(group, [k] * 8, [k if copying else 0] * 8, 0.0, 0.1 + 0.01 * k,
                           k + 1)
        return ks, group

    ks, group = run(shadowed=True, steps=PROBE - 2 if copying else 4 * PROBE)
    if copying:
        assert ks[0] == 0 and max(ks) > 0 and min(r.spec_alpha for r in group) > 0.5
    else:
        assert max(ks) == 0 and max(r.spec_alpha for r in group) < 0.05
    ks, group = run(shadowed=False)
    assert max(ks) == 0 and all(r.spec_alpha == 0.05 for r in group)


def test_the_engine_shadows_only_drafters_whose_proposals_are_free():
    from mlx_tandem.drafters.draft_model import DraftModelSource
    from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
    from mlx_tandem.engine.core import EngineCore

    lookup = EngineCore(tiny(), drafter=PromptLookupSource(), depth=AdaptiveDepth(3))
    assert lookup.depth.shadow is not None
    handle = lookup.submit([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=24))
    lookup.run_until_idle()
    assert handle.request.spec_seen > 0  # measured, drafted or shadowed
    draft = EngineCore(tiny(), drafter=DraftModelSource(tiny()), depth=AdaptiveDepth(3))
    assert draft.depth.shadow is None  # its proposals cost a forward (and it samples)


def test_depths_past_a_verify_blocks_reach_are_refused():
    """A verify block is at most MAX_DRAFT + 1 slots: the sliding layers' rings are sized
    for that widest append, so a deeper policy would overwrite positions still in a window."""
    from mlx_tandem.drafters.factory import build_depth
    from mlx_tandem.engine.sampling import MAX_DRAFT

    assert FixedDepth(MAX_DRAFT).k == MAX_DRAFT and AdaptiveDepth(MAX_DRAFT).k_max == MAX_DRAFT
    for make in (FixedDepth, AdaptiveDepth, lambda k: build_depth("fixed", k)):
        with pytest.raises(ValueError, match=f"in \\[.*{MAX_DRAFT}\\]"):
            make(MAX_DRAFT + 1)


@pytest.mark.parametrize("filtered", [True, False])
def test_an_isolated_stall_is_not_learned_but_a_change_of_speed_is(filtered, monkeypatch):
    """Eight rows whose drafts do not pay at a plain step of 85 ms. One plain step stalled
    to 340 ms (the server's measured case) leaves the costs as they were; two slow steps in
    a row are a change of speed and move them. Without the filter (the negative control)
    the one stall moves the plain cost to 136 ms, drafted steps look 40% cheaper than they
    are, and the rows draft; a stalled drafted step likewise makes drafting dearer."""
    if not filtered:
        monkeypatch.setattr(depth, "STALL", float("inf"))
    policy = AdaptiveDepth(4)
    eight = rows(8, alpha=0.44)
    calibrate(policy, eight, plain_s=0.085, per_token_s=0.04)
    costs = policy.costs[8]
    policy.steps = 1
    assert policy.depths(eight) == [0] * 8
    policy.observe(eight, [0] * 8, [0] * 8, 0.0, 0.34, 1)
    assert (costs.plain_s == pytest.approx(0.085)) == filtered
    assert (policy.depths(eight) == [0] * 8) == filtered
    per_token = costs.fit(1).per_token_s
    policy.observe(eight, [3] * 8, [0] * 8, 0.0, 4 * 0.205, 4)  # a drafted step stalled 4x
    assert (costs.fit(1).per_token_s == pytest.approx(per_token)) == filtered
    if filtered:
        policy.observe(eight, [0] * 8, [0] * 8, 0.0, 0.085, 1)
        for _ in range(2):
            policy.observe(eight, [0] * 8, [0] * 8, 0.0, 0.34, 1)
        assert costs.plain_s == pytest.approx(0.8 * 0.085 + 0.2 * 0.34)
