"""The ``kvtier`` command line: ``cli.py`` is the entry point (``kvtier``, ``python -m kvtier``), and
each subcommand is one module that gives ``add_arguments(parser)`` and ``run(args)``:

```
 kvtier eval      eval.py      accuracy against footprint of cache configurations (kvtier.eval runs them)
 kvtier plan      plan.py      KV bytes per token and tier sizes (kvtier.plan computes them)
 kvtier generate  generate.py  chat with a model through a kvtier cache (kvtier.models loads it)
 kvtier cache     cache.py     inspect and manage L3 directories (kvtier.cache_admin does the work)
```
``cliargs.py`` holds the argument types they share (sizes, token counts, choices). Nothing outside
this package imports it: the library under it knows no argparse.
"""
