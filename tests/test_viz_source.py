"""viz.source: a fault's diff comes from the registry's own parts and shows only its wrong lines."""

import pytest

from pagedkv_lab import faults, viz

PEER = [f for f in faults.REGISTRY if f.family == "peer kernel"]


@pytest.mark.parametrize("fault", PEER, ids=[f.name for f in PEER])
def test_kernel_copy_diff_touches_only_the_marked_lines(fault):
    diff = viz.fault_diff(fault, "kernel")
    assert diff.added and all("# the fault" in line for line in diff.added), diff
    assert diff.removed, diff  # the correct line(s) the fault replaced


def test_diff_of_a_subclass_shows_only_the_overridden_method():
    (fault,) = [f for f in faults.REGISTRY if f.name == "no_copy_on_write" and f.family == "harness"]
    diff = viz.fault_diff(fault, "manager")
    assert diff.added == ["        return False"], diff
    assert "        return self.allocator.refcount(block) > 1" in diff.removed


def test_diff_html_highlights_changed_lines_without_script():
    diff = viz.fault_diff(PEER[0], "kernel")
    page = diff._repr_html_()
    assert "<script" not in page and "http" not in page
    assert page.count("background:#d9f2dd") == len(diff.added)
    assert page.count("background:#fde0dc") == len(diff.removed)


def test_every_fault_shows_nonempty_source():
    for fault in faults.REGISTRY:
        shown = viz.show_fault(fault)
        assert shown and all(d.lines for d in shown), fault.name


def test_fault_diff_refuses_a_role_without_a_correct_part():
    (fault,) = [f for f in faults.REGISTRY if f.name == "minus_one_as_index"]
    with pytest.raises(ValueError, match="role='append_fn'"):
        viz.fault_diff(fault, "append_fn")
    with pytest.raises(ValueError, match="context=-1"):
        viz.source_diff(len, len, context=-1)


HARNESS = list(faults.faults_of("harness").values())


@pytest.mark.parametrize("fault", HARNESS, ids=[f.name for f in HARNESS])
def test_a_harness_fault_is_shown_as_one_wrong_line_in_at_most_12_lines(fault):
    """Notebook 08's form (issue 40): the correct line in red (absent for a wrapper), the
    one wrong line in green, two lines of context; never the whole function."""
    (shown,) = viz.show_fault(fault, context=2)
    assert len(shown.lines) <= 12, shown
    assert len(shown.added) == 1, shown
    assert len(shown.removed) == (1 if fault.replaces or not fault.parts else 0), shown


def test_fault_branch_shows_the_else_as_correct_and_the_if_as_wrong():
    (fault,) = [f for f in HARNESS if f.name == "stale_block_table"]
    shown = viz.show_fault(fault)[0]
    assert shown.removed == ['    table = manager.block_table("C")'] and shown.added == ["    table = stale"], shown
    assert shown.lines[0].startswith("@@ pagedkv_lab.verify.scenarios.check_reused_page, line ")
    assert len(shown.lines) == 1 + 2 + 1 + 1 + 2, shown  # header, context, correct, wrong, context
    scenario = faults.load("pagedkv_lab.verify.scenarios:check_reused_page")
    with pytest.raises(ValueError, match="name='past_len_zero'"):
        viz.fault_branch(scenario, "past_len_zero")
    with pytest.raises(ValueError, match="context=-1"):
        viz.fault_branch(scenario, "stale_block_table", context=-1)


def test_marked_source_with_context_shows_the_def_a_gap_and_the_marked_line():
    shown = viz.marked_source(faults.minus_one_as_index, context=1)
    assert shown.lines[0].startswith(" def minus_one_as_index(") and shown.lines[1] == " ⋮", shown
    assert len(shown.added) == 1 and "torch.where(slots < 0" in shown.added[0], shown
    assert len(shown.lines) == 1 + 1 + 3 + 1, shown  # def, gap, context-marked-context, gap
    assert len(viz.marked_source(faults.minus_one_as_index).lines) == 13  # without context: whole
    with pytest.raises(ValueError, match="context=-1"):
        viz.marked_source(len, context=-1)
