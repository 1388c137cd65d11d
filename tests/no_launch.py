"""A stand-in for a Triton kernel in the argument-check tests: the checks must refuse a
bad call before anything is launched, so any launch of the stand-in fails the test."""


class NoLaunch:
    """Stands in for a kernel (``module.kernel = NoLaunch()``): ``kernel[grid]`` fails."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched before validation finished")
