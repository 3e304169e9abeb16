"""What a graph's raw outputs become before they are served: detections from a detector's head.

`nms.py` holds the reference: greedy non-maximum suppression in numpy, the textbook algorithm, one candidate
after another (its settings, NmsConfig, live on the ground floor: core/nms_config.py).  `nms_graph.py` appends the
same suppression to an ONNX graph in a fixed-size form that TensorRT builds and ONNX Runtime runs; the tests hold it
to the reference.
"""
