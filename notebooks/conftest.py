"""nbval settings for the notebooks in this folder."""

import pagedkv_lib  # noqa: F401  (chooses the Triton backend before anything imports triton)


def pytest_collectstart(collector):
    # Widget views hold model ids that change on every run; nbval already skips
    # application/vnd.jupyter.widget-view+json, and HTML mirrors of plots vary too.
    if hasattr(collector, "skip_compare"):
        collector.skip_compare += ("text/html", "application/vnd.jupyter.widget-state+json")
