"""The media edge: ``WS /v1/sessions/{sid}/media`` (``routes``), its close codes (``codes``), the budget its
transcripts spend (``budget``) and its part of the AsyncAPI document (``asyncapi``)."""
