"""The one fault registry (:mod:`pagedkv_lab.faults`): faults live outside the code they
break. The engine's step holds no fault name, every registry entry's part really is a
replacement (it differs from the part it stands in for; a faulty kernel copy differs
from the correct kernel only in its marked lines), and every fault has a test that
catches it. Cheap: source reads and imports, no kernel launch (about 1 s, most of it
importing triton for the kernel copies)."""

from __future__ import annotations

import ast
import difflib
import inspect
import re
from pathlib import Path

import pytest

from pagedkv_lab import faults

ROOT = Path(__file__).resolve().parents[1]

# The test that catches each fault of the engine, peer-kernel, caches, read-route and concurrency families (the
# harness families are held to their checks by tests/test_verify.py::test_every_fault_has_a_check).
CAUGHT_IN = {
    ("read route", "page_pointers_element_stride"): (
        "test_kernel_read_routes.py",
        "test_a_page_pointer_array_built_with_an_element_stride_is_refused_before_launch",
    ),
    ("read route", "page_pointers_any_pool"): (
        "test_kernel_read_routes.py",
        "test_a_page_pointer_plan_is_refused_on_another_pool_or_after_its_pool_moved",
    ),
    ("engine", "decode_rope_off_by_one"): (
        "test_engine_units.py",
        "test_planted_decode_rope_off_by_one_is_caught_at_the_first_decode",
    ),
    ("engine", "no_copy_on_write"): ("test_engine_units.py", "test_planted_no_copy_on_write_is_caught_at_the_fork"),
    ("engine", "rollback_keeps_drafts"): (
        "test_engine_units.py",
        "test_planted_rollback_keeps_drafts_is_caught_at_the_first_token_after_a_rejection",
    ),
    ("peer kernel", "no_minus_one_guard"): (
        "test_verify_foreign.py",
        "test_a_missing_minus_one_guard_is_reported_with_the_tensor_and_offset_and_the_run_goes_on",
    ),
    ("peer kernel", "unguarded_v_store"): ("test_verify_foreign.py", "test_an_unguarded_v_store_is_located_by_element"),
    ("peer kernel", "off_by_one_block"): (
        "test_verify_foreign.py",
        "test_an_off_by_one_block_index_is_located_by_sequence_and_head",
    ),
    ("concurrency", "no_lock"): ("test_manager_threads.py", "test_planted_no_lock_is_caught_by_the_stress_test"),
    ("peer kernel", "whole_page_loads"): (
        "test_vllm_verify.py",
        "test_a_kernel_that_reads_the_unwritten_tail_of_a_last_page_is_told_so",
    ),
    ("caches", "slot_by_count"): (
        "test_caches_before_paging.py",
        "test_planted_slot_by_count_gives_a_live_sequences_slot_to_a_newcomer",
    ),
    ("caches", "shared_length"): (
        "test_caches_before_paging.py",
        "test_planted_shared_length_writes_layer_one_a_row_too_far",
    ),
    ("caches", "one_row_append"): ("test_caches_before_paging.py", "test_planted_one_row_append_cannot_take_a_chunk"),
    ("caches", "read_before_write"): (
        "test_caches_before_paging.py",
        "test_planted_read_before_write_leaves_a_token_blind_to_itself",
    ),
    ("caches", "gqa_repeat_copy"): (
        "test_caches_before_paging.py",
        "test_planted_gqa_repeat_copy_copies_group_times_the_bytes",
    ),
}
STEP_PATH = (
    "step",
    "_forward",
    "_verify",
    "_emit",
    "_mark_written",
    "_prepare",
    "_record",
    "_sample",
    "_pick",
    "_fork",
    "_append_token",
    "run",
)


def _engine_methods() -> dict[str, str]:
    """Source of each method of ``pagedkv_engine.engine.Engine``, by name."""
    source = (ROOT / "pagedkv_engine" / "engine.py").read_text()
    engine = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {f.name: ast.get_source_segment(source, f) for f in engine.body if isinstance(f, ast.FunctionDef)}


def test_engine_step_path_has_no_fault_name_and_no_branch_on_one():
    source = (ROOT / "pagedkv_engine" / "engine.py").read_text()
    named = sorted({f.name for f in faults.REGISTRY if f.name in source})
    assert not named, f"pagedkv_engine/engine.py names the faults {named}: a fault is a part, not a branch"
    methods = _engine_methods()
    assert set(STEP_PATH) <= methods.keys()
    branching = [m for m in STEP_PATH if re.search(r"fault", methods[m])]
    assert not branching, f"Engine.{branching} mention faults; the step uses only self.parts"


def test_engine_parts_with_faults_are_the_registry_parts_and_the_rest_are_correct():
    from pagedkv_engine.parts import EngineParts  # imports neither transformers nor triton

    correct = EngineParts()
    for fault in faults.faults_of("engine").values():
        parts = faults.engine_parts({fault.name})
        for role in ("positions", "manager", "attention"):
            want = fault.part(role) if role in fault.parts else getattr(correct, role)
            assert getattr(parts, role) is want, f"{fault.name}: the {role} part"
    with pytest.raises(ValueError, match=r"faults=\['typo'\] unknown"):
        faults.engine_parts({"typo"})


def test_every_replacement_part_differs_from_the_part_it_replaces():
    for fault in faults.REGISTRY:
        assert fault.family in faults.FAMILIES and fault.wrong
        assert fault.parts or fault.where, f"{fault.name}: no part and no word on where the harness plants it"
        assert set(fault.replaces) <= set(fault.parts), f"{fault.name}: replaces a part it does not provide"
        for role in fault.parts:
            part = fault.part(role)
            assert callable(part), f"{fault.name}: {role} part {part!r}"
            if role in fault.replaces:
                assert part is not fault.correct(role), f"{fault.name}: the {role} part is the correct one"


def _kernel_source(kernel) -> list[str]:
    return inspect.getsource(kernel.fn).splitlines()


@pytest.mark.parametrize("name", list(faults.PEER_KERNEL_FAULTS))
def test_a_faulty_kernel_copy_differs_from_the_correct_kernel_only_in_its_marked_lines(name):
    pytest.importorskip("triton")
    fault = faults.faults_of("peer kernel")[name]
    bad, good = _kernel_source(fault.part("kernel")), _kernel_source(fault.correct("kernel"))
    changed = [line for line in difflib.ndiff(good, bad) if line[:2] in ("- ", "+ ")]
    added = [line[2:] for line in changed if line.startswith("+ ")]
    assert len(added) >= 2, f"{name}: the copy should differ in its name and its wrong line(s)"
    renamed = f"def {fault.correct('kernel').fn.__name__}_{name}("
    for line in added:
        assert renamed in line or "# the fault" in line, f"{name}: unmarked change {line!r}"
    assert len(changed) <= 8, f"{name}: a diff of {len(changed)} lines is more than the wrong line(s)"


def test_every_engine_peer_kernel_cache_route_and_concurrency_fault_has_a_test_that_catches_it():
    families = ("engine", "peer kernel", "caches", "read route", "concurrency")
    assert set(CAUGHT_IN) == {(f.family, f.name) for f in faults.REGISTRY if f.family in families}
    for (family, name), (path, test) in CAUGHT_IN.items():
        assert f"def {test}(" in (ROOT / "tests" / path).read_text(), f"{family} fault {name}: {path}::{test} is gone"


def test_the_harness_names_are_exactly_its_families_and_unknown_names_are_refused():
    assert set(faults.FAULTS) == set(faults.faults_of("harness", "quantized"))
    assert faults.check_faults({"past_len_zero"}) == {"past_len_zero"}
    with pytest.raises(ValueError, match=r"faults=\['decode_rope_off_by_one'\] unknown"):
        faults.check_faults({"decode_rope_off_by_one"})  # an engine fault: not the harness's
    with pytest.raises(ValueError, match="families"):
        faults.faults_of("kernel")


@pytest.mark.parametrize("name", ["past_len_zero", "int32_offset"])
def test_a_harness_copy_differs_from_the_function_it_replaces_in_its_one_marked_line(name):
    """The faulty copies notebook 08 shows as one wrong line: the same source (the name
    aside) but for one line, which carries ``# the wrong line``."""
    fault = faults.faults_of("harness")[name]
    (role,) = fault.replaces
    good = inspect.getsource(fault.correct(role)).splitlines()
    bad = inspect.getsource(fault.part(role)).replace(fault.part(role).__name__, fault.correct(role).__name__, 1)
    changed = [(g, b) for g, b in zip(good, bad.splitlines(), strict=True) if g != b]
    assert len(changed) == 1 and "# the wrong line" in changed[0][1], changed
    assert changed[0][1].partition("#")[0].strip() != changed[0][0].strip(), f"{name}: only a comment differs"
