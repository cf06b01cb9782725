"""executor: apply a plan with torch.distributed (DDP, FSDP2, DTensor TP/SP, pipelining), train, and measure.

Reads a `Plan` and the model; never imports the search or the cost model, so a hand-written plan and a searched plan
go through the same code.
"""
