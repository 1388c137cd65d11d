"""Prompt-lookup drafts and their acceptance (pagedkv_engine.speculative): pure functions, and
the manager part that records each rollback (no model)."""

import pytest

from pagedkv_engine.speculative import RecordingManager, num_accepted, propose_ngram


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed():
    # "... 7 8 9 | 1 2 3 7 8" ends with "7 8", which occurred at 0: propose what followed.
    assert propose_ngram([7, 8, 9, 1, 2, 3, 7, 8], 2) == [9, 1]
    assert propose_ngram([7, 8, 9, 1, 2, 3, 7, 8], 10) == [9, 1, 2, 3, 7, 8]  # up to the end


def test_the_longest_suffix_that_matches_wins_over_an_earlier_shorter_one():
    # "2 5" occurs at 0 (followed by 6) but "1 2 5" occurs at 3 (followed by 4): n = 3 first.
    assert propose_ngram([2, 5, 6, 1, 2, 5, 4, 0, 1, 2, 5], 1) == [4]
    # Shortest n is min_n: a one-token suffix proposes nothing with the default min_n = 2.
    assert propose_ngram([3, 4, 3], 2) == []
    assert propose_ngram([3, 4, 3], 2, min_n=1) == [4, 3]


def test_the_earliest_occurrence_is_used_as_vllm_does():
    assert propose_ngram([1, 2, 3, 1, 2, 4, 1, 2], 1) == [3]


def test_no_match_no_drafts_and_bad_arguments_are_refused():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([1, 2, 1, 2], 0) == []
    assert propose_ngram([], 3) == [] and propose_ngram([5], 3) == []
    with pytest.raises(ValueError, match="num_drafts=-1"):
        propose_ngram([1], -1)
    with pytest.raises(ValueError, match="min_n=3 <= max_n=2"):
        propose_ngram([1], 1, max_n=2, min_n=3)


def test_acceptance_counts_the_leading_drafts_the_model_confirms():
    # targets[i] is the model's greedy token after the drafts before i.
    assert num_accepted([4, 5, 6], [4, 5, 6, 9]) == 3  # all accepted, 9 is the bonus token
    assert num_accepted([4, 5, 6], [4, 7, 6, 9]) == 1  # 5 rejected: 6 after it does not count
    assert num_accepted([4, 5, 6], [0, 5, 6, 9]) == 0
    assert num_accepted([], [3]) == 0


def test_recording_manager_notes_the_pool_just_before_and_after_each_rollback():
    mgr = RecordingManager(6, 4, prefix_cache=True)
    mgr.admit("s", list(range(7)))
    mgr.commit("s", num_tokens=6)  # position 6 is the last sampled token; it and 4 drafts are appended
    mgr.append_tokens("s", 4, [7, 8, 9, 10])
    free = mgr.num_free
    mgr.rollback("s", 0)  # every draft accepted: nothing to note
    released = mgr.rollback("s", 3)
    (rb,) = mgr.rollbacks
    assert (rb.seq_id, rb.start, rb.num_tokens, rb.num_drafts, rb.accepted) == ("s", 6, 3, 4, 1)
    assert rb.table_before[:2] == rb.table_after and rb.released == released == rb.table_before[2:]
    assert (rb.len_before, rb.len_after) == (11, 8)
    assert rb.refcounts_before == [2, 1, 1] and rb.refcounts_after == [2, 1, 0], "page 0 is cached, page 2 freed"
    assert (rb.free_before, rb.free_after) == (free, free + 1)
