"""Integrations with serving engines (vLLM), each in one subpackage; importing this imports no engine."""
