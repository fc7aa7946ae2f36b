"""The released CP functions training can call (`cp.preprocess=LIBRARY@VERSION`): `source` finds
and loads a release's file, `releases` the functions and their contract call, `prelude` the
plain-Python loader both `source` and the checker's standalone reproducers use. The checker of
released code is `recipe/checks/upstream/`."""
