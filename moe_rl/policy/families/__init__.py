"""One file per HF model family: how its `config.json` reads into `MoEArch`, how its tensors map to
megatron's, its engine-side names, and the tiny model the tests and the demo build of it.

`registry.py` lists them; `family.py` holds the `Family` record and the pieces several share. Adding
a family is one file here, one line in `registry.py` and its test in `tests/distributed/test_families.py`.
"""
