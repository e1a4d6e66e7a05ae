"""Schemathesis checks for the fuzz test (loaded by the CLI through SCHEMATHESIS_HOOKS)."""

import schemathesis


@schemathesis.check
def no_server_error_in_stream(ctx, response, case):
    """A 200 stream that carries an engine failure is a 5xx in all but status."""
    if response.status_code == 200 and '"server_error"' in response.text:
        raise AssertionError(f"server error inside a 200 response: {response.text[:300]}")
