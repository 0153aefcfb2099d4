"""Generated from proto/specgate/v1/specgate.proto by gateway.protogen."""
