"""BERT pretraining core: model, masking, loader, DeepSpeed loop, checkpoints, export. No Ray."""
