"""What API keys and tenants may use (``limits``): tokens per minute and per day, requests at once, held
across workers and replicas (:mod:`.shared`), and the decision to admit or refuse (:mod:`.enforcer`)."""
