"""The torch.compile side: options, the ordered pipeline, the peak-budget search, the
Dynamo/AOTAutograd/Inductor wiring."""
