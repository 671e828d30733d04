"""Draft heads that read the target's hidden states, as pure functions over param pytrees.

One module per family, imported explicitly (nothing is imported here, so each family loads on its own):
`specjax.heads.eagle` (EAGLE-1/2 and EAGLE-3), `specjax.heads.medusa`. The drafters that run them live in
`specjax.drafters`, their file formats in `specjax.heads.eagle_io`, their training in `specjax.train`.
"""
