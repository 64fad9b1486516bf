"""The torch.compile side: options, the ordered pipeline, the Dynamo/AOTAutograd/Inductor
wiring."""
