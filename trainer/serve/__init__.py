"""After training: scoring a run on a split, and its model used on its own.

    evaluate.py    ``dutycycle evaluate``: a commit's weights (checkpoint/weights.py) scored on a split, from the
                   cache or decoded from the table (evaldata.py); the files it writes (evalfiles.py)
    preprocess.py  file path / bytes / PIL image -> the normalized tensor the model was trained on (the recorded
                   transform through ``engine.transform.decode_and_transform``, the safe open's limits)
    load.py        ``load_model(run_dir)``: the network in eval mode with its classes and preprocessing, from
                   ``model.safetensors`` alone (``step.modelfile`` reads and checks its metadata)
    export.py      ``dutycycle export``: a ``torch.export`` program and ONNX, each checked against the model
    predict.py     ``dutycycle predict``: top-k classes for image files, folders or a metadata table
    cli.py         predict's and export's arguments; evaluate_cli.py evaluate's
"""
