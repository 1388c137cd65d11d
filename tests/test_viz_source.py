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
