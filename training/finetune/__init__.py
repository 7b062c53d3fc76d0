"""Fine-tuning a pretrained BERT on GLUE and SQuAD v1.1: data, metrics, model, loop, export."""
