"""What the longer commands do: the stage runner behind `demo`, `pipeline`, `finetune` and
`glue`, the chain's stage bodies, `prepare` inside its dataset guard, fine-tuning sweeps."""
