# adapters/my_adapter/model.py
from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter
import json

@input_formatter
def custom_input_formatter(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    """
    Adapter-specific input formatter - only applies when this adapter is used.
    Overrides the base model formatter for this adapter.
    
    Args:
        decoded_payload (dict): Decoded request payload
        tokenizer: Tokenizer instance (optional)
        **kwargs: Additional arguments
        
    Returns:
        (dict): Transformed payload in expected format
    """
    # Adapter-specific preprocessing
    if "inputs" in decoded_payload:
        # Add adapter-specific prefix
        decoded_payload["inputs"] = f"[ADAPTER_PREFIX] {decoded_payload['inputs']}"
    
    # Adapter-specific parameter defaults
    if "parameters" not in decoded_payload:
        decoded_payload["parameters"] = {}
    
    decoded_payload["parameters"].setdefault("temperature", 0.7)
    decoded_payload["parameters"].setdefault("max_new_tokens", 512)
    
    return decoded_payload


@output_formatter
def custom_output_formatter(response_data: dict) -> dict:
    """
    Adapter-specific output formatter - only applies when this adapter is used.
    Overrides the base model formatter for this adapter.

    Args:
        response_data (dict): The final response data containing 'generated_text', 'details', etc.

    Returns:
        (dict): Modified response data with custom fields
    """
    if 'generated_text' in response_data:
        # Add adapter-specific metadata
        response_data['adapter_name'] = 'my_adapter'
        response_data['adapter_version'] = '1.0'
        
        # Adapter-specific text transformation
        generated_text = response_data['generated_text']
        response_data['generated_text'] = f"[ADAPTER] {generated_text}"
        
        # Add custom metrics
        response_data['custom_metrics'] = {
            'text_length': len(generated_text),
            'word_count': len(generated_text.split())
        }
    
    return response_data
