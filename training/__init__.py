"""BERT pretraining core: model, masking loader, DeepSpeed engine, loop, checkpoints, export. No Ray here."""
