"""The bottom layer: what a request and an answer are, the domain's errors, the names of contexts and the
facts owners share. Imports nothing of the gateway's."""
