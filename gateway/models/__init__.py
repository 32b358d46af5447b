"""Model names that platform teams manage: public names and the targets they mean (:mod:`.rules`), and
LoRA adapters registered on the pods where requests need them (:mod:`.adapters`)."""
