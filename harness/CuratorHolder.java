// A Java service's locks, for the tests that share a znode with one: Apache Curator's
// InterProcessMutex and InterProcessReadWriteLock, driven one line at a time over stdin.
//
//   take <id> <mutex|read|write> <path> <timeout ms>  ->  "held <id> <node>" or "timeout <id>"
//   release <id>                                        ->  "released <id>"
//   owns <id>                                           ->  "owns <id> <isAcquiredInThisProcess()>"
//   where                                               ->  "at <port of the server it is connected to>"
//
// Its connection's states, as a Java service's ConnectionStateListener hears them, come unasked:
// "state SUSPENDED", "state LOST", "state RECONNECTED" (a Curator lock itself never says it is lost:
// a Java service learns it from these).
//
// Each lock lives on a thread of its own: a Curator lock is released by the thread that took it.
// The session's timeout is the first argument's: a killed holder's locks go when it ends.
import java.util.Map;
import java.util.Scanner;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.SynchronousQueue;
import java.util.concurrent.TimeUnit;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.state.ConnectionState;
import org.apache.curator.retry.RetryOneTime;

public class CuratorHolder {
    static final Map<String, SynchronousQueue<Boolean>> releases = new ConcurrentHashMap<>();
    static final Map<String, InterProcessMutex> locks = new ConcurrentHashMap<>();

    static synchronized void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        CuratorFramework client = CuratorFrameworkFactory.newClient(
            args[0], Integer.parseInt(args[1]), 5000, new RetryOneTime(100));
        client.getConnectionStateListenable().addListener(
            (c, state) -> { if (state != ConnectionState.CONNECTED) say("state " + state); });
        client.start();
        client.blockUntilConnected(10, TimeUnit.SECONDS);
        say("ready");
        Scanner in = new Scanner(System.in);
        while (in.hasNextLine()) {
            String[] w = in.nextLine().trim().split(" ");
            if (w[0].equals("take")) {
                String id = w[1], kind = w[2], path = w[3];
                long timeout = Long.parseLong(w[4]);
                SynchronousQueue<Boolean> release = new SynchronousQueue<>();
                releases.put(id, release);
                // A daemon: a lock never let go (its session lost) keeps no JVM alive once stdin ends.
                Thread t = new Thread(() -> hold(client, id, kind, path, timeout, release));
                t.setDaemon(true);
                t.start();
            } else if (w[0].equals("release")) {
                releases.remove(w[1]).put(true);
            } else if (w[0].equals("owns")) {
                InterProcessMutex lock = locks.get(w[1]);
                say("owns " + w[1] + " " + (lock != null && lock.isAcquiredInThisProcess()));
            } else if (w[0].equals("where")) {
                // "State:CONNECTED Timeout:3000 sessionid:0x... local:/127.0.0.1:5 remoteserver:/127.0.0.1:7 ..."
                String cnxn = client.getZookeeperClient().getZooKeeper().toString();
                java.util.regex.Matcher m = java.util.regex.Pattern.compile("remoteserver:\\S*:(\\d+)").matcher(cnxn);
                say("at " + (m.find() ? m.group(1) : "none"));
            }
        }
        client.close();
    }

    static void hold(CuratorFramework client, String id, String kind, String path, long timeout,
                     SynchronousQueue<Boolean> release) {
        try {
            InterProcessMutex lock = kind.equals("mutex") ? new InterProcessMutex(client, path)
                : kind.equals("read") ? new InterProcessReadWriteLock(client, path).readLock()
                : new InterProcessReadWriteLock(client, path).writeLock();
            locks.put(id, lock);
            if (!lock.acquire(timeout, TimeUnit.MILLISECONDS)) {
                say("timeout " + id);
                return;
            }
            String mine = "";
            for (String node : client.getChildren().forPath(path)) {
                if (lock.isOwnedByCurrentThread() && node.startsWith("_c_")
                        && client.checkExists().forPath(path + "/" + node).getEphemeralOwner()
                           == client.getZookeeperClient().getZooKeeper().getSessionId()) {
                    mine = mine.isEmpty() ? node : mine + "," + node;
                }
            }
            say("held " + id + " " + mine);
            release.take();
            lock.release();
            say("released " + id);
        } catch (Exception e) {
            say("error " + id + " " + e);
        }
    }
}
