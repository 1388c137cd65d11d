"""Grading a class without trusting the learners' code.

A learner's notebook is code, and autograding runs it. nbgrader's own ``autograde``
runs every cell in a Jupyter kernel with the instructor's rights, and reads the grade
from what that kernel says; a learner can rebind ``check``, read the solutions, rewrite
``nbgrader_config.py`` or kill the grader. Here the work is split in two processes:

* the **learner process** (:mod:`.learner`) runs the learner's cells, and then only
  answers calls of their functions; it runs inside the sandbox (:mod:`.sandbox`: its own
  namespaces, a user of its own, a root filesystem holding the Python, the suite and
  nothing else, no network, limits, a deadline; built by :mod:`.sandbox_root`), forked
  from a warm Python (:mod:`.zygote`) or started on its own (:mod:`.launch`);
* the **checker** (:mod:`.remote`), in the grader's process, runs the exercise's check
  with stand-ins for the learner's functions: each call is sent to the learner process
  as data and its result comes back as data (:mod:`.wire`, no pickle). The grade is
  computed here, from what the learner's functions returned, by the suite's own code.

:mod:`.autograde` plugs this into ``nbgrader autograde`` in place of nbgrader's kernel
execution (the course's ``nbgrader_config.py`` names it), :mod:`.class_grading` is the
instructor's ``python -m pagedkv_lab.exercises grade`` and :mod:`.feedback` renders the
feedback's formulas without the network. ``docs/grading.md`` is the manual.

Importing this package imports nothing: the sandbox's first process uses the standard
library only.
"""
