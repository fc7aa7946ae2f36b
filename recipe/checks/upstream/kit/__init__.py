"""What every library plugin shares: the checked-function interface, the Registry, the stand-ins
and the plain-Python references, and the functions training can call as checked functions."""
