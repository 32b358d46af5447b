"""``gateway epp``: the gateway's decisions served to Envoy as a Gateway API inference endpoint picker."""
