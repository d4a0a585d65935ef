"""hf_tev's tiny model kit, as package data: one folder per model (`target`, `assistant-ar`, `drafter-dflash`,
`drafter-dflash-l135`), `prompts/` and `data/`.

hf_tev finds this folder without importing it (`hf_tev.packaged.kit_dir`) and loads the models with
`hf_tev.packaged.load_kit_model`. How each model was made: the model cards, and `research/tiny_kit/` of the
hf_tev repository.
"""
