# model.py (in base model directory)
from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter
import time

@input_formatter
def custom_input_formatter(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    """
    Base model input formatter - applies to all requests by default.
    
    Args:
        decoded_payload (dict): Decoded request payload
        tokenizer: Tokenizer instance (optional)
        **kwargs: Additional arguments
        
    Returns:
        (dict): Transformed payload in expected format
    """
    # Example: Transform custom "inputPrompt" field to "inputs"
    if "inputPrompt" in decoded_payload:
        decoded_payload["inputs"] = decoded_payload.pop("inputPrompt")
    
    # Example: Set default parameters
    if "parameters" not in decoded_payload:
        decoded_payload["parameters"] = {}
    
    decoded_payload["parameters"].setdefault("max_new_tokens", 256)
    
    return decoded_payload


@output_formatter
def custom_output_formatter(response_data: dict) -> dict:
    """
    Base model output formatter - applies to all responses by default.

    Args:
        response_data (dict): The final response data containing 'generated_text', 'details', etc.

    Returns:
        (dict): Modified response data with custom fields
    """
    if 'generated_text' in response_data:
        # Add custom processing timestamp
        response_data['custom_formatter_applied'] = True
        response_data['formatter_timestamp'] = int(time.time())
        
        # Example: Transform the generated text
        generated_text = response_data['generated_text']
        response_data['original_length'] = len(generated_text)
        response_data['generated_text'] = f"[BASE] {generated_text}"
    
    return response_data
