"""The media edge: ``WS /v1/sessions/{sid}/media`` (``routes``), its close codes (``codes``) and its part of the
AsyncAPI document (``asyncapi``)."""
