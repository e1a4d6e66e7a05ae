from bench.peers.compare import main

main()
