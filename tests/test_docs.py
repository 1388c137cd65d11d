"""The README is a landing page and the manuals in docs/ cannot rot silently: every relative
link (and its #anchor) resolves, every manual is linked from the README, every
`python -m X` names a module that exists, every path into the checkout exists, and every
dotted name of the suite resolves. Cost: about 2 s (imports of the named modules)."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LIMIT = 10_240  # bytes: a landing page (issue 35: FlashInfer's README is ~10 KB)
# Manuals that other branches add; linked already, tolerated as missing until they land.
PENDING: set[str] = set()


def pages() -> list[Path]:
    """The Markdown a reader navigates: the README, the manuals, the two indexes, CONTRIBUTING."""
    indexes = [ROOT / "notebooks/README.md", ROOT / "exercises/README.md", ROOT / "CONTRIBUTING.md"]
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *indexes]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link's text may be code:
    ``[`docs/setup.md`](docs/setup.md)`` keeps its target)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens (a link inside the heading keeps its text)."""
    text = re.sub(r"\]\([^)]*\)", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading's get -1, -2, ...)."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``page`` whose file (or, in a Markdown file, #anchor) is missing."""
    problems = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            if path.parent == DOCS and path.name in PENDING:
                continue
            problems.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return problems


def test_the_readme_is_a_landing_page_of_at_most_10_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/ (limit {README_LIMIT})"


def test_every_relative_link_resolves():
    problems = [p for page in pages() for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_link_check_fails_on_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Set-up: two commands\n\n## Is it ready? `make doctor`\n\n### `window_left`\n")
    page = tmp_path / "page.md"
    good = "## Own heading\n\n" + (
        "[a](other.md) [b](other.md#set-up-two-commands) [`c`](other.md#is-it-ready-make-doctor) [d](https://x.org/y)"
        " [g](#own-heading) [h](other.md#window_left)"
    )
    page.write_text(good)
    assert broken_links(page, tmp_path) == []
    page.write_text(good + " [`e`](missing.md)")
    assert broken_links(page, tmp_path) == ["page.md: missing.md (no such file)"]
    page.write_text(good + " [f](other.md#set-up)")
    assert broken_links(page, tmp_path) == ["page.md: other.md#set-up (no such heading)"]


def test_every_manual_is_linked_from_the_readme():
    readme = set(links((ROOT / "README.md").read_text()))
    manuals = {f"docs/{p.name}" for p in DOCS.glob("*.md")} | {f"docs/{name}" for name in PENDING}
    missing = sorted(m for m in manuals if m not in readme and m != "docs/README.md")
    assert not missing, f"README.md does not link {missing}"
    assert "docs/README.md" in readme, "README.md does not link the index of the manuals"


def test_pending_manuals_have_not_landed():
    """Once a pending manual exists, it is checked like any other: take it off PENDING."""
    landed = sorted(name for name in PENDING if (DOCS / name).exists())
    assert not landed, f"{landed} exist now in docs/: remove them from PENDING in tests/test_docs.py"


def modules_run(text: str) -> set[str]:
    return set(re.findall(r"python3? -m ([A-Za-z_][\w.]*)", text))


def test_every_python_dash_m_module_exists():
    named = {m for page in pages() for m in modules_run(page.read_text())}
    assert {"pagedkv_kernels.tools.verify", "pagedkv_lab.exercises", "pagedkv_engine"} <= named
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"`python -m` of modules that do not exist: {missing}"


def test_the_module_check_fails_on_a_module_that_moved():
    named = modules_run("run `python -m kernels.verify` or `python3 -m pagedkv_lab.verify`")
    assert named == {"kernels.verify", "pagedkv_lab.verify"}
    assert [m for m in sorted(named) if importlib.util.find_spec(m) is None] == ["kernels.verify"]


CHECKOUT_PATH = re.compile(
    r"(?<![\w/.~-])((?:scripts|tests|benchmarks|kernels|pagedkv_lib|pagedkv_lab|pagedkv_engine|notebooks|exercises"
    r"|\.ci)/[\w./-]*[\w/])"
)


def checkout_paths(text: str) -> set[str]:
    """Paths into the checkout named in ``text`` (a placeholder like ``NN_name`` aside)."""
    return {p for p in CHECKOUT_PATH.findall(text) if "NN" not in p}


def test_every_path_into_the_checkout_exists():
    generated = ("build/", "benchmarks/results", ".venv")
    absent = {"kernels/__init__.py"}  # CONTRIBUTING says why it must not exist
    missing = sorted(
        f"{page.relative_to(ROOT)}: {p}"
        for page in pages()
        for p in checkout_paths(page.read_text())
        if not (ROOT / p).exists() and not p.startswith(generated) and p not in absent
    )
    assert not missing, "\n".join(missing)


def test_the_path_check_fails_on_an_old_path():
    text = "see `kernels/write.py` and kernels/pagedkv_kernels/write.py, ~/.cache/pagedkv, src/NN_name.py"
    assert sorted(p for p in checkout_paths(text) if not (ROOT / p).exists()) == ["kernels/write.py"]


# The suite's packages, and the short names notebooks and the manuals use for its modules
# (`import pagedkv_kernels as kernels`, `from pagedkv_lab import verify`, ...).
ALIASES = {
    "kernels": "pagedkv_kernels",
    "runtime": "pagedkv_lib.runtime",
    "quant": "pagedkv_lib.quant",
    "verify": "pagedkv_lab.verify",
    "viz": "pagedkv_lab.viz",
    "faults": "pagedkv_lab.faults",
}
SUITE_NAME = re.compile(
    r"(?<![\w./])((?:pagedkv_lib|pagedkv_kernels|pagedkv_lab|pagedkv_engine|" + "|".join(ALIASES) + r")(?:\.\w+)+)"
)


def unresolved(name: str) -> bool:
    """Whether ``name`` (with a short name of :data:`ALIASES` spelled out) names no module,
    nor an attribute of one."""
    head, _, rest = name.partition(".")
    parts = f"{ALIASES.get(head, head)}.{rest}".split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return True
            obj = getattr(obj, attr)
        return False
    return True


def test_every_dotted_name_of_the_suite_resolves():
    names = {n for page in pages() for n in SUITE_NAME.findall(page.read_text()) if not n.endswith((".py", ".md"))}
    assert len(names) > 30, sorted(names)
    missing = sorted(n for n in names if unresolved(n))
    assert not missing, f"names in the docs that do not exist: {missing}"


@pytest.mark.parametrize(
    "name, gone",
    [
        ("pagedkv_lab.poisoning.masked_lanes_poisoned", False),
        ("kernels.paged_prefill_attention", False),
        ("verify.run_case", False),
        ("pagedkv_lib.runtime.masked_lanes_poisoned", True),
        ("runtime.masked_lanes_poisoned", True),
        ("pagedkv_lib.verify", True),
    ],
)
def test_the_name_check_fails_on_a_name_that_moved(name, gone):
    assert unresolved(name) is gone
