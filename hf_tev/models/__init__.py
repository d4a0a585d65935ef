"""The models hf_tev defines, one folder each in the layout transformers uses (`transformers/models/<name>/`):
`hf_tev.models.dflash`, the DFlash drafter."""
