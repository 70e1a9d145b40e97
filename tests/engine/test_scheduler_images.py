"""The scheduler with images (types.ImageRef): prefix-cache blocks are keyed by each image's hash
(two images behind the same placeholder tokens never share a KV block, the same image does), and
every step item carries exactly the images whose tokens it feeds, chunk by chunk. No torch."""
from __future__ import annotations

from handler.engine.blocks import BlockManager
from handler.engine.request import SamplingParams
from handler.engine.scheduler import Scheduler, SchedulerPolicy, Sequence
from handler.engine.types import ImageRef
from tests.support.fakes import FakeRunner

BS = 4
IMG = 9     # the placeholder token id: the same for every image, as a processor writes it


def prompt_with_image(n_before=6, length=10, n_after=7):
    return [1 + i % 7 for i in range(n_before)] + [IMG] * length + [2 + i % 5 for i in range(n_after)]


def make(budget=4096):
    return Scheduler(SchedulerPolicy("paged", prefix_caching=True, prefill_token_budget=budget, max_model_len=256,
                                     eos_token_ids=frozenset()),
                     BlockManager(64, BS, enable_prefix_caching=True))


def run(s: Scheduler, seq: Sequence, runner: FakeRunner) -> list:
    """Run one sequence to its end; the items it was fed."""
    s.add(seq)
    fed = []
    while seq.seq_id in s.seqs:
        plan = s.schedule(0.0)
        fed += plan.items
        for q, _ in s.update(plan, runner.step(plan.items, plan.copies)):
            if q.finished:
                s.finish(q.seq_id, q.finish_reason)
    return fed


def image_seq(sid, key, **kw):
    return Sequence(sid, prompt_with_image(), SamplingParams(max_new_tokens=2), 0.0,
                    media=(ImageRef(key, 6, 10, data=key),), **kw)


def test_two_images_behind_the_same_tokens_share_no_block():
    s, runner = make(), FakeRunner(BS)
    run(s, image_seq(1, "red"), runner)
    other = image_seq(2, "blue")
    run(s, other, runner)
    # only the block before the image (positions 0-3) is the same; block 1 holds an image token
    assert other.cached_tokens == BS
    again = image_seq(3, "red")
    run(s, again, runner)
    # the same image: every full prompt block but the one holding the last token
    assert again.cached_tokens == (len(again.prompt_ids) - 1) // BS * BS
    plain = Sequence(4, prompt_with_image(), SamplingParams(max_new_tokens=2), 0.0)     # no image at all
    run(s, plain, runner)
    assert plain.cached_tokens == BS
    s.blocks.check_invariants()


def test_each_chunk_carries_the_images_it_feeds():
    s, runner = make(budget=4), FakeRunner(BS)
    seq = image_seq(1, "red")
    fed = run(s, seq, runner)
    for it in fed:
        end = it.start_pos + len(it.token_ids)
        touches = it.start_pos < 16 and end > 6          # the image is positions 6..15
        assert (it.media == seq.media) == touches and (not it.media) == (not touches), (it.start_pos, end)
    assert [it.start_pos for it in fed if it.media] == [4, 8, 12]     # 4-token chunks over positions 6..15


def test_a_whole_image_run_is_never_cut_by_a_chunk():
    """An image whose runs attend both ways at prefill (ImageRef.whole, Gemma 3): a chunk ends at a run's
    first token, or takes the run whole past the budget (4 tokens here, runs of 10 and 3); a chunk that
    starts inside a run (a prefix-cache hit) runs to its end. Other images are cut as before."""
    s, runner = make(budget=4), FakeRunner(BS)
    prompt = prompt_with_image() + [IMG] * 3 + [3, 4, 5, 6, 7]     # runs at 6..15 and 23..25
    seq = Sequence(1, prompt, SamplingParams(max_new_tokens=2), 0.0,
                   media=(ImageRef("red", 6, 13, data="red", runs=((6, 10), (23, 3)), whole=True),))
    fed = run(s, seq, runner)
    chunks = [(it.start_pos, it.start_pos + len(it.token_ids)) for it in fed if it.start_pos < len(prompt)]
    assert chunks == [(0, 4), (4, 6), (6, 16), (16, 20), (20, 23), (23, 27), (27, 31)], chunks
    assert seq.chunk_end(8, 4) == 16 - 8 and seq.chunk_end(2, 20) == 20    # starts inside / ends past both
    assert seq.chunk_end(20, 4) == 3 and seq.chunk_end(23, 1) == 3
    s.blocks.check_invariants()
