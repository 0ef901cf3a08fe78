"""Router initialisation and routing losses."""
