"""pagedkv_lab: the top floor of the suite, what teaches and verifies:

* :mod:`pagedkv_lab.verify`: the conformance harness (``verify.run`` on your kernels,
  grids, scenarios, contracts, reports; ``python -m pagedkv_lab.verify``);
* :mod:`pagedkv_lab.faults`: the one registry of planted bugs (replacement parts);
* :mod:`pagedkv_lab.peer_kernels`: kernels written to other engines' conventions, the
  harness's fixtures;
* :mod:`pagedkv_lab.viz` and :mod:`pagedkv_lab.widgets`: every plot and widget;
* :mod:`pagedkv_lab.exercises`: the workshop's exercises, checker and nbgrader course
  (``python -m pagedkv_lab.exercises``);
* :mod:`pagedkv_lab.notebook`: every notebook's first cell, ``setup()``;
* :mod:`pagedkv_lab.poisoning`: poisoned masked lanes for the lab's runs.

It may import every floor below (``pagedkv_lib``, ``pagedkv_kernels``,
``pagedkv_engine``), but importing a module here never imports Triton or the kernels
(notebooks 01-05 run without them): what needs them imports them when it runs.
"""
