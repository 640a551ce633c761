"""LoRA adapters served beside the base model (issue 55).

peft_adapter.py  a PEFT adapter folder read for the model's fused projections, named by its
                 weights (``digest``)
lora_step.py     one step's rows per adapter and the products added to the projections
"""
