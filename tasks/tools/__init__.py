"""The manual tools: what people run by hand beside the DAG (make sanity, inspect, lr-find, review-label-errors,
add-data, add-weights, promote; summary after make run), each as `python -m tasks.tools.<name>`. No DVC stage
imports them."""
