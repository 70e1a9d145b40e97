from djl_python import Input, Output

# Missing handle function - should fall back to vLLM
def some_other_function():
    return "This is not a handle function"
